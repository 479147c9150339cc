//! The body both backward launches share: a cube owns a block of rows (keys for dK/dV, queries
//! for dQ) as two tile operands and walks blocks of the other side staged in shared memory. Per
//! staged block it recomputes `P` from the scores and the saved log-sum-exp, forms
//! `dS = P ∘ (dP − D)`, and accumulates the owned rows' gradients with the same tile products as
//! the forward (`scores` for `K·Qᵀ`/`V·dOᵀ`, `accumulate` for `Pᵀ·dO`/`dSᵀ·Q`/`dS·K`).

use cubecl::prelude::*;

use crate::kernel::config::TileConfig;
use crate::kernel::mask::{block_needs_mask, key_visible};
use crate::kernel::stage::{fetch_stage, load_block, StageBarriers};
use crate::kernel::tile::AttentionTile;
use crate::kernel::TilePath;

/// Where a backward cube sits and the lengths that bound it.
#[derive(CubeType, Clone, Copy)]
pub struct Span {
    /// First owned row (a key when the cube owns keys, else a query).
    pub owned_start: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    /// Offset of this (batch, head) in the log-sum-exp and D, both `[b, h, seq_q]` contiguous.
    pub stat_base: usize,
}

/// A per-query statistic (log-sum-exp or D); 0 for rows past the end, whose staged operands are
/// zeros so that they add nothing.
#[cube]
fn query_stat(stat: &Tensor<f32>, span: Span, query: usize) -> f32 {
    let valid = query < span.seq_q;
    select(
        valid,
        stat[span.stat_base + select(valid, query, 0usize)],
        0.0,
    )
}

/// The staged blocks `[first_block, end_block)` of `first` (the score product's right operand,
/// `cfg.head_dim` wide) and `second` (`dP`'s, `cfg.value_dim` wide), rows bounded by `seq`.
/// Tensor-core tile: two stages filled by asynchronous copies, the next block in flight while
/// one is computed; portable tile: one stage of plain loads.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn walk<E: Float, T: AttentionTile<E>>(
    first_owned: &T::Query,
    second_owned: &T::Query,
    first: &Tensor<E>,
    first_base: usize,
    second: &Tensor<E>,
    second_base: usize,
    first_block: usize,
    end_block: usize,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    span: Span,
    scale: f32,
    grad_first: &mut Array<f32>,
    grad_second: &mut Array<f32>,
    #[comptime] owns_keys: bool,
    #[comptime] cfg: TileConfig,
) {
    let seq = if comptime!(owns_keys) {
        span.seq_q
    } else {
        span.seq_k
    };
    // Statistics of owned query rows are read once; staged ones per block.
    let rows = comptime!(cfg.rows_per_unit());
    let mut owned_lse = Array::<f32>::new(rows);
    let mut owned_delta = Array::<f32>::new(rows);
    if comptime!(!owns_keys) {
        #[unroll]
        for slot in 0..rows {
            let query = span.owned_start + T::slot_row(slot, cfg);
            owned_lse[slot] = query_stat(lse, span, query);
            owned_delta[slot] = query_stat(delta, span, query);
        }
    }

    if comptime!(cfg.tile == TilePath::TensorCore) {
        let mut first_stages =
            SharedMemory::<E>::new_aligned(comptime!(2 * cfg.block_kv * cfg.head_dim), 16usize);
        let mut second_stages =
            SharedMemory::<E>::new_aligned(comptime!(2 * cfg.block_kv * cfg.value_dim), 16usize);
        let barriers = StageBarriers::new();
        sync_cube();
        if first_block < end_block {
            fetch_stage::<E>(
                first,
                first_base,
                second,
                second_base,
                first_block * cfg.block_kv,
                seq,
                &mut first_stages,
                &mut second_stages,
                0,
                &barriers,
                cfg,
            );
        }
        for block in first_block..end_block {
            let stage = (block - first_block) % 2;
            barriers.wait(stage);
            if block + 1 < end_block {
                fetch_stage::<E>(
                    first,
                    first_base,
                    second,
                    second_base,
                    (block + 1) * cfg.block_kv,
                    seq,
                    &mut first_stages,
                    &mut second_stages,
                    1 - stage,
                    &barriers,
                    cfg,
                );
            }
            block_grads::<E, T>(
                first_owned,
                second_owned,
                &first_stages,
                &second_stages,
                stage,
                block * cfg.block_kv,
                lse,
                delta,
                &owned_lse,
                &owned_delta,
                span,
                scale,
                grad_first,
                grad_second,
                owns_keys,
                cfg,
            );
        }
    } else {
        let mut first_stage = SharedMemory::<E>::new(comptime!(cfg.block_kv * cfg.head_dim));
        let mut second_stage = SharedMemory::<E>::new(comptime!(cfg.block_kv * cfg.value_dim));
        for block in first_block..end_block {
            let first_row = block * cfg.block_kv;
            sync_cube();
            load_block::<E>(
                first,
                first_base,
                first_row,
                seq,
                &mut first_stage,
                cfg.block_kv,
                cfg.head_dim,
                cfg.units(),
                cfg.swizzle(),
            );
            load_block::<E>(
                second,
                second_base,
                first_row,
                seq,
                &mut second_stage,
                cfg.block_kv,
                cfg.value_dim,
                cfg.units(),
                cfg.swizzle(),
            );
            sync_cube();
            block_grads::<E, T>(
                first_owned,
                second_owned,
                &first_stage,
                &second_stage,
                0,
                first_row,
                lse,
                delta,
                &owned_lse,
                &owned_delta,
                span,
                scale,
                grad_first,
                grad_second,
                owns_keys,
                cfg,
            );
        }
    }
}

/// Gradients from the staged block at `stage` whose first row is `staged_start`:
/// owning keys, `dV += Pᵀ·dO` and `dK += dSᵀ·Q`; owning queries, `dQ += dS·K` (unscaled).
#[cube]
#[allow(clippy::too_many_arguments)]
fn block_grads<E: Float, T: AttentionTile<E>>(
    first_owned: &T::Query,
    second_owned: &T::Query,
    first_stages: &SharedMemory<E>,
    second_stages: &SharedMemory<E>,
    stage: usize,
    staged_start: usize,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    owned_lse: &Array<f32>,
    owned_delta: &Array<f32>,
    span: Span,
    scale: f32,
    grad_first: &mut Array<f32>,
    grad_second: &mut Array<f32>,
    #[comptime] owns_keys: bool,
    #[comptime] cfg: TileConfig,
) {
    let first_base = stage * comptime!(cfg.block_kv * cfg.head_dim);
    let second_base = stage * comptime!(cfg.block_kv * cfg.value_dim);
    // S = owned·stagedᵀ (K·Qᵀ or Q·Kᵀ) and dP (V·dOᵀ or dO·Vᵀ), in the same register layout.
    let mut probs = T::scores(first_owned, first_stages, first_base, cfg);
    let mut grads = T::scores(
        second_owned,
        second_stages,
        second_base,
        comptime!(cfg.with_widths(cfg.value_dim, cfg.value_dim)),
    );

    // Registers are (owned row, staged row): which is the query depends on the side owned.
    #[unroll]
    for reg in 0..cfg.score_regs() {
        let slot = comptime!(cfg.score_slot(reg));
        let (_row, col) = T::score_position(reg, cfg);
        let (row_lse, row_delta) = if comptime!(owns_keys) {
            (
                query_stat(lse, span, staged_start + col),
                query_stat(delta, span, staged_start + col),
            )
        } else {
            (owned_lse[slot], owned_delta[slot])
        };
        let p = (probs[reg] * scale - row_lse).exp();
        probs[reg] = p;
        grads[reg] = p * (grads[reg] - row_delta);
    }

    let (q_start, kv_start) = if comptime!(owns_keys) {
        (staged_start, span.owned_start)
    } else {
        (span.owned_start, staged_start)
    };
    let q_rows = comptime!(if owns_keys { cfg.block_kv } else { cfg.block_q });
    let kv_rows = comptime!(if owns_keys { cfg.block_q } else { cfg.block_kv });
    if block_needs_mask(
        q_start, q_rows, kv_start, kv_rows, span.seq_q, span.seq_k, cfg.causal,
    ) {
        // Hidden pairs may have overflowed to inf above; select drops them without arithmetic.
        #[unroll]
        for reg in 0..cfg.score_regs() {
            let (row, col) = T::score_position(reg, cfg);
            let (query, key) = if comptime!(owns_keys) {
                (q_start + col, kv_start + row)
            } else {
                (q_start + row, kv_start + col)
            };
            let visible = key_visible(query, key, span.seq_q, span.seq_k, cfg.causal);
            probs[reg] = select(visible, probs[reg], 0.0);
            grads[reg] = select(visible, grads[reg], 0.0);
        }
    }

    if comptime!(owns_keys) {
        T::accumulate(&probs, second_stages, second_base, grad_second, cfg);
    }
    T::accumulate(
        &grads,
        first_stages,
        first_base,
        grad_first,
        comptime!(cfg.with_widths(cfg.head_dim, cfg.head_dim)),
    );
}
