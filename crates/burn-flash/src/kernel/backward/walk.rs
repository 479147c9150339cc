//! The body both backward launches share: a cube owns a block of rows (keys for dK/dV, queries
//! for dQ) as two tile operands and walks blocks of the other side staged in shared memory. Per
//! staged block it recomputes `P` from the scores and the saved log-sum-exp, forms
//! `dS = P ∘ (dP − D)`, and accumulates the owned rows' gradients with the same tile products as
//! the forward (`scores` for `K·Qᵀ`/`V·dOᵀ`, `accumulate` for `Pᵀ·dO`/`dSᵀ·Q`/`dS·K`). Owning
//! keys with an atomic dQ, it also adds `dSᵀ·K` to the staged queries' dQ accumulator. Owning
//! queries with a bias gradient asked for, it writes `dS` (before the scale and the softcap's
//! slope: the gradient of the bias) as it goes. With dropout, the forward's keep decisions are
//! regenerated: `dV` takes the dropped and rescaled `P`, and `dS = P ∘ (dP ∘ Z − D)` with `Z` the
//! rescaled keep mask (`D` is already the dropped output's row dot).

use cubecl::prelude::*;

use crate::kernel::band::{Band, block_needs_mask, key_visible};
use crate::kernel::config::{SMEM_ALIGN, TMA_ALIGN, TailPart, TileConfig, TilePath};
use crate::kernel::dropout::{Dropout, keep_mask};
use crate::kernel::inputs::{
    Views, add_bias, alibi_slope, mask_input_allows, pair_of, write_bias_grad,
};
use crate::kernel::softmax::{Softcap, exp2};
use crate::kernel::stage::{
    StageBarriers, copy_or_zero_fill, fetch_stage, fetch_stage_tma, load_block, smem_anchor,
};
use crate::kernel::tile::AttentionTile;

/// Where a backward cube sits and the lengths that bound it.
#[derive(CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct Span {
    /// First owned row (a key when the cube owns keys, else a query).
    pub owned_start: usize,
    pub band: Band,
    pub softcap: Softcap,
    pub inv_scale: f32,
    pub dropout: Dropout,
    /// The largest power of two not above the query head count (ALiBi's slopes).
    pub alibi_pow2: u32,
}

/// The lengths, head counts and strides a backward launch indexes with, passed as launch
/// scalars. CubeCL 0.10 reads a tensor's shape and strides from a metadata buffer in global
/// memory, and what is loaded from memory lives in per-thread registers: the dK/dV single pass
/// has none to spare, so the compiler kept them (and the walk's bounds derived from them) in
/// local memory and reloaded them every block. Scalars sit in the launch's constant bank, and
/// what the cube derives from them alone in its uniform registers.
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub struct WalkDims {
    pub seq_q: usize,
    pub seq_k: usize,
    /// Query heads and key/value heads.
    pub heads: usize,
    pub kv_heads: usize,
    /// Batch, head and row strides of the staged tensors: Q and dO owning keys, K and V owning
    /// queries.
    pub first_strides: Strides,
    pub second_strides: Strides,
    /// Batch and head strides of the log-sum-exp and D (`[b, h, seq_q]`).
    pub stat_strides: Strides,
}

/// Batch, head and row strides of a `[batch, heads, rows, ..]` tensor.
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub struct Strides {
    pub batch: usize,
    pub head: usize,
    pub row: usize,
}

#[cube]
impl Strides {
    /// Offset of (`batch`, `head`).
    pub fn at(&self, batch: usize, head: usize) -> usize {
        batch * self.batch + head * self.head
    }
}

#[cube]
impl WalkDims {
    /// The band of these lengths with these offsets.
    pub fn band(&self, left: u32, right: u32) -> Band {
        Band {
            seq_q: self.seq_q,
            seq_k: self.seq_k,
            left: left as usize,
            right: right as usize,
        }
    }
}

/// The staged side of a walk: blocks `[first_block, end_block)` of `first` (the score product's
/// right operand, `cfg.head_dim` wide) and `second` (`dP`'s, `cfg.value_dim` wide), for each of
/// `members` heads. Owning keys under GQA, the members are the query heads that read the owned
/// key/value head; otherwise there is one. Bases are those of member 0; each further member
/// adds its step (the tensors' head stride).
#[derive(CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct Sweep {
    pub first_base: usize,
    pub first_step: usize,
    pub first_row_stride: usize,
    pub second_base: usize,
    pub second_step: usize,
    pub second_row_stride: usize,
    /// Offset of member 0's (batch, query head) in the log-sum-exp and D (`[b, h, seq_q]`
    /// contiguous, so one step serves both).
    pub stat_base: usize,
    pub stat_step: usize,
    /// Offset of member 0's head in the dQ accumulator and the step per member (atomic dQ
    /// only).
    pub accum_base: usize,
    pub accum_step: usize,
    pub members: usize,
    pub first_block: usize,
    pub end_block: usize,
    /// The batch and member 0's query head (the mask, bias and bias gradient are per query
    /// head).
    pub batch: usize,
    pub first_head: usize,
}

#[cube]
impl Sweep {
    /// Staged blocks per member.
    pub fn blocks(&self) -> usize {
        self.end_block - self.first_block
    }

    /// (member, first staged row) of the walk's first step.
    pub fn start(&self, #[comptime] cfg: TileConfig) -> (usize, usize) {
        (0usize, self.first_block * cfg.block_kv)
    }

    /// (member, first staged row) of step `step`: [`start`](Self::start)'s unless the walk
    /// is a piece of one ([`TailPart::Pieces`]).
    pub fn step_at(&self, step: usize, #[comptime] cfg: TileConfig) -> (usize, usize) {
        if comptime!(cfg.tail == TailPart::Pieces) {
            let blocks = self.blocks();
            (
                step / blocks,
                (self.first_block + step % blocks) * cfg.block_kv,
            )
        } else {
            self.start(cfg)
        }
    }

    /// (member, first staged row) of the step after (`member`, `row`): members take their
    /// blocks in turn. Stepping by a compare instead of dividing the step index saves an
    /// integer division (some twenty instructions) per use.
    pub fn advance(
        &self,
        member: usize,
        row: usize,
        #[comptime] cfg: TileConfig,
    ) -> (usize, usize) {
        let next = row + cfg.block_kv;
        let wrap = next == self.end_block * cfg.block_kv;
        (
            select(wrap, member + 1, member),
            select(wrap, self.first_block * cfg.block_kv, next),
        )
    }
}

/// A per-query statistic (log-sum-exp or D) of the head at `stat_base`; 0 for rows past the
/// end, whose staged operands are zeros so that they add nothing.
#[cube]
fn query_stat(stat: &Tensor<f32>, stat_base: usize, span: Span, query: usize) -> f32 {
    let valid = query < span.band.seq_q;
    select(valid, stat[stat_base + select(valid, query, 0usize)], 0.0)
}

/// Value `id` of the statistics of the queries `[first_row, first_row + cfg.block_kv)` of the
/// head at `stat_base`: the log-sum-exp of row `id` below `cfg.block_kv`, else D of row
/// `id - cfg.block_kv`. Returns whether it exists (`id` in the block, its row below `seq_q`)
/// and its source: the tensor (log-sum-exp or not) and the index, clamped into the tensor.
#[cube]
fn stat_source(
    id: usize,
    stat_base: usize,
    first_row: usize,
    seq_q: usize,
    #[comptime] cfg: TileConfig,
) -> (bool, bool, usize) {
    let row = first_row + id % cfg.block_kv;
    let valid = row < seq_q && id < comptime!(2 * cfg.block_kv);
    (
        valid,
        id < cfg.block_kv,
        stat_base + select(valid, row, 0usize),
    )
}

/// Issue asynchronous copies of the log-sum-exp and D of the queries `[first_row, first_row +
/// cfg.block_kv)` of the head at `stat_base` into slot `slot` of `stats` (`2 · cfg.block_kv`
/// per slot: [`stat_source`]'s order), zeros past the end, to be committed with the stage's
/// copies. Owning keys, every score register needs the statistics of its staged query: staged
/// with the block, they cost two shared reads per column pair instead of two global reads and
/// bound checks per register, and no register holds them while the block before computes.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fetch_stats(
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    stat_base: usize,
    first_row: usize,
    seq_q: usize,
    stats: &mut Shared<[f32]>,
    slot: usize,
    #[comptime] cfg: TileConfig,
) {
    #[unroll]
    for i in 0..comptime!(cfg.stats_per_unit()) {
        let id = comptime!(i * cfg.units()) + UNIT_POS as usize;
        let (valid, is_lse, at) = stat_source(id, stat_base, first_row, seq_q, cfg);
        let dst = slot * comptime!(2 * cfg.block_kv) + id;
        if id < comptime!(2 * cfg.block_kv) {
            if is_lse {
                copy_or_zero_fill(lse, at, valid, stats, dst, 1usize);
            } else {
                copy_or_zero_fill(delta, at, valid, stats, dst, 1usize);
            }
        }
    }
}

/// [`fetch_stats`] with plain loads into the single slot of the portable tile's `stats`; the
/// caller synchronises the cube.
#[cube]
fn load_stats(
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    stat_base: usize,
    first_row: usize,
    seq_q: usize,
    stats: &mut Shared<[f32]>,
    #[comptime] cfg: TileConfig,
) {
    #[unroll]
    for i in 0..comptime!(cfg.stats_per_unit()) {
        let id = comptime!(i * cfg.units()) + UNIT_POS as usize;
        let (valid, is_lse, at) = stat_source(id, stat_base, first_row, seq_q, cfg);
        let value = if is_lse { lse[at] } else { delta[at] };
        if id < comptime!(2 * cfg.block_kv) {
            stats[id] = select(valid, value, 0.0);
        }
    }
}

/// Walk `steps` (member, block) steps of `sweep` from step `first_step` (0 unless a piece,
/// [`TailPart::Pieces`]) in one loop, so the pipeline runs on across members.
/// Tensor-core tile: two stages filled by asynchronous copies (by `first_map` and `second_map`,
/// tensor maps of `first` and `second`, with `cfg.tma`), the next block in flight while one is
/// computed; portable tile: one stage of plain loads.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn walk<E: Float, M: Int, T: AttentionTile<E>, N: Size>(
    first_owned: &T::Query,
    second_owned: &T::Query,
    first: &Tensor<E>,
    second: &Tensor<E>,
    first_map: &ComptimeOption<TensorMap<E, Tiled>>,
    second_map: &ComptimeOption<TensorMap<E, Tiled>>,
    mask: ComptimeOption<&Tensor<M>>,
    bias: ComptimeOption<&Tensor<E>>,
    d_bias: &mut ComptimeOption<&mut Tensor<E>>,
    sweep: Sweep,
    first_step: usize,
    steps: usize,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    span: Span,
    scale: f32,
    grad_first: &mut Array<f32>,
    grad_second: &mut Array<f32>,
    accum: &mut ComptimeOption<&mut Tensor<Atomic<Vector<f32, N>>>>,
    #[comptime] owns_keys: bool,
    #[comptime] cfg: TileConfig,
) {
    let seq = if comptime!(owns_keys) {
        span.band.seq_q
    } else {
        span.band.seq_k
    };
    // Statistics of owned query rows are read once; staged ones per block. The log-sum-exp is
    // kept in base 2, as `exp2` takes it.
    let rows = comptime!(cfg.rows_per_unit());
    let mut owned_lse = Array::<f32>::new(rows);
    let mut owned_delta = Array::<f32>::new(rows);
    if comptime!(!owns_keys) {
        #[unroll]
        for slot in 0..rows {
            let query = span.owned_start + T::slot_row(slot, cfg);
            owned_lse[slot] =
                query_stat(lse, sweep.stat_base, span, query) * core::f32::consts::LOG2_E;
            owned_delta[slot] = query_stat(delta, sweep.stat_base, span, query);
        }
    }
    let stats_elems = comptime!(if owns_keys { cfg.stats_elems() } else { 1 });
    let mut stats = Shared::<[f32]>::new_slice(stats_elems);

    if comptime!(cfg.tile == TilePath::TensorCore) {
        let stage_align = comptime!(if cfg.tma { TMA_ALIGN } else { SMEM_ALIGN });
        let mut first_stages = Shared::<[E]>::new_aligned_slice(
            comptime!(2 * cfg.block_kv * cfg.head_stride()),
            stage_align,
        );
        let mut second_stages = Shared::<[E]>::new_aligned_slice(
            comptime!(2 * cfg.block_kv * cfg.value_stride()),
            stage_align,
        );
        let mut scratch = Shared::<[E]>::new_aligned_slice(cfg.scratch_elems(), SMEM_ALIGN);
        let mut staging = Shared::<[f32]>::new_aligned_slice(cfg.dq_stage_elems(), SMEM_ALIGN);
        let barriers = StageBarriers::new(2usize);
        if comptime!(cfg.tma) {
            // The copy engine completes on the barriers: their initialisation must be visible
            // to it.
            sync_async_proxy_shared();
        }
        sync_cube();
        let (mut member, mut row) = sweep.step_at(first_step, cfg);
        if steps > 0 {
            fetch_step::<E>(
                first,
                second,
                first_map,
                second_map,
                lse,
                delta,
                sweep,
                member,
                row,
                seq,
                &mut first_stages,
                &mut second_stages,
                &mut stats,
                0,
                &barriers,
                owns_keys,
                cfg,
            );
        }
        for step in 0..steps {
            let stage = step % 2;
            barriers.wait(stage);
            let (next_member, next_row) = sweep.advance(member, row, cfg);
            if step + 1 < steps {
                fetch_step::<E>(
                    first,
                    second,
                    first_map,
                    second_map,
                    lse,
                    delta,
                    sweep,
                    next_member,
                    next_row,
                    seq,
                    &mut first_stages,
                    &mut second_stages,
                    &mut stats,
                    1 - stage,
                    &barriers,
                    owns_keys,
                    cfg,
                );
            }
            block_grads::<E, M, T, N>(
                first_owned,
                second_owned,
                &first_stages,
                &second_stages,
                stage,
                row,
                mask,
                bias,
                d_bias,
                sweep.batch,
                sweep.first_head + member,
                &owned_lse,
                &owned_delta,
                span,
                scale,
                grad_first,
                grad_second,
                &mut scratch,
                &mut staging,
                accum,
                sweep.accum_base + member * sweep.accum_step,
                &stats,
                stage * comptime!(2 * cfg.block_kv),
                owns_keys,
                cfg,
            );
            member = next_member;
            row = next_row;
        }
    } else {
        let mut scratch = Shared::<[E]>::new_slice(1usize);
        let mut staging = Shared::<[f32]>::new_slice(1usize);
        let mut first_stage = Shared::<[E]>::new_slice(comptime!(cfg.block_kv * cfg.head_dim));
        let mut second_stage = Shared::<[E]>::new_slice(comptime!(cfg.block_kv * cfg.value_dim));
        let (mut member, mut first_row) = sweep.step_at(first_step, cfg);
        for _ in 0..steps {
            sync_cube();
            load_block::<E>(
                first,
                sweep.first_base + member * sweep.first_step,
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
                sweep.second_base + member * sweep.second_step,
                first_row,
                seq,
                &mut second_stage,
                cfg.block_kv,
                cfg.value_dim,
                cfg.units(),
                cfg.swizzle(),
            );
            if comptime!(owns_keys) {
                load_stats(
                    lse,
                    delta,
                    sweep.stat_base + member * sweep.stat_step,
                    first_row,
                    seq,
                    &mut stats,
                    cfg,
                );
            }
            sync_cube();
            block_grads::<E, M, T, N>(
                first_owned,
                second_owned,
                &first_stage,
                &second_stage,
                0,
                first_row,
                mask,
                bias,
                d_bias,
                sweep.batch,
                sweep.first_head + member,
                &owned_lse,
                &owned_delta,
                span,
                scale,
                grad_first,
                grad_second,
                &mut scratch,
                &mut staging,
                accum,
                sweep.accum_base + member * sweep.accum_step,
                &stats,
                0,
                owns_keys,
                cfg,
            );
            let (next_member, next_row) = sweep.advance(member, first_row, cfg);
            member = next_member;
            first_row = next_row;
        }
    }
}

/// Issue the copies of the block at `row` of member `member` of `sweep` into stage `stage`,
/// with its statistics owning keys, and commit them to that stage's barrier.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fetch_step<E: Float>(
    first: &Tensor<E>,
    second: &Tensor<E>,
    first_map: &ComptimeOption<TensorMap<E, Tiled>>,
    second_map: &ComptimeOption<TensorMap<E, Tiled>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    sweep: Sweep,
    member: usize,
    row: usize,
    seq: usize,
    first_stages: &mut Shared<[E]>,
    second_stages: &mut Shared<[E]>,
    stats: &mut Shared<[f32]>,
    stage: usize,
    barriers: &StageBarriers,
    #[comptime] owns_keys: bool,
    #[comptime] cfg: TileConfig,
) {
    #[comptime]
    if let (ComptimeOption::Some(first_map), ComptimeOption::Some(second_map)) =
        (first_map, second_map)
    {
        fetch_stage_tma::<E>(
            first_map,
            second_map,
            sweep.batch,
            sweep.first_head + member,
            row,
            first_stages,
            second_stages,
            stage,
            barriers,
            cfg,
        );
    } else {
        fetch_stage::<E>(
            first,
            sweep.first_base + member * sweep.first_step,
            sweep.first_row_stride,
            second,
            sweep.second_base + member * sweep.second_step,
            sweep.second_row_stride,
            row,
            seq,
            first_stages,
            second_stages,
            stage,
            cfg,
        );
    }
    if comptime!(owns_keys) {
        fetch_stats(
            lse,
            delta,
            sweep.stat_base + member * sweep.stat_step,
            row,
            seq,
            stats,
            stage,
            cfg,
        );
    }
    barriers.commit(stage);
}

/// Gradients from the staged block at `stage` whose first row is `staged_start`, for query
/// head `head`: owning keys, `dV += Pᵀ·dO` and `dK += dSᵀ·Q`, and with an accumulator its block
/// of `dQ += dS·K` by atomics; owning queries, `dQ += dS·K` and the bias gradient if asked. All
/// unscaled.
#[cube]
#[allow(clippy::too_many_arguments)]
fn block_grads<E: Float, M: Int, T: AttentionTile<E>, N: Size>(
    first_owned: &T::Query,
    second_owned: &T::Query,
    first_stages: &Shared<[E]>,
    second_stages: &Shared<[E]>,
    stage: usize,
    staged_start: usize,
    mask: ComptimeOption<&Tensor<M>>,
    bias: ComptimeOption<&Tensor<E>>,
    d_bias: &mut ComptimeOption<&mut Tensor<E>>,
    batch: usize,
    head: usize,
    owned_lse: &Array<f32>,
    owned_delta: &Array<f32>,
    span: Span,
    scale: f32,
    grad_first: &mut Array<f32>,
    grad_second: &mut Array<f32>,
    scratch: &mut Shared<[E]>,
    staging: &mut Shared<[f32]>,
    accum: &mut ComptimeOption<&mut Tensor<Atomic<Vector<f32, N>>>>,
    accum_base: usize,
    stats: &Shared<[f32]>,
    stats_base: usize,
    #[comptime] owns_keys: bool,
    #[comptime] cfg: TileConfig,
) {
    let first_base = stage * comptime!(cfg.block_kv * cfg.head_stride());
    let second_base = stage * comptime!(cfg.block_kv * cfg.value_stride());
    // Registers are (owned row, staged row): which is the query depends on the side owned.
    let (q_start, kv_start) = if comptime!(owns_keys) {
        (staged_start, span.owned_start)
    } else {
        (span.owned_start, staged_start)
    };
    let views = Views::new::<E, M>(mask, bias, batch, head);

    // S = owned·stagedᵀ (K·Qᵀ or Q·Kᵀ); dP (V·dOᵀ or dO·Vᵀ) below, in the same register layout.
    let mut probs = T::scores(first_owned, first_stages, first_base, cfg);

    // The softcap's derivative, 1 − tanh², per score: dS of the raw score is dS of the capped
    // one times it.
    let mut slope = Array::<f32>::new(comptime!(if cfg.softcap { cfg.score_regs() } else { 1 }));
    if comptime!(cfg.softcap) {
        #[unroll]
        for reg in 0..cfg.score_regs() {
            let t = (probs[reg] * span.softcap.inner).tanh();
            probs[reg] = span.softcap.outer * t;
            slope[reg] = 1.0 - t * t;
        }
    }
    add_bias::<E, T>(
        &mut probs,
        bias,
        views.bias,
        span.band,
        q_start,
        kv_start,
        span.inv_scale,
        alibi_slope(head, span.alibi_pow2) * span.inv_scale,
        owns_keys,
        cfg,
    );

    let keep = keep_mask::<E, T>(
        &span.dropout,
        span.dropout.head_key(batch, head),
        q_start,
        kv_start,
        owns_keys,
        cfg,
    );
    // The staged statistics of register 0's column; the others are a compile-time distance
    // from it. The log-sum-exp is staged as saved and taken to base 2 per column read.
    let scale2 = scale * core::f32::consts::LOG2_E;
    let (_row, first_col) = T::score_position(0usize, cfg);
    let stats_at = smem_anchor(stats_base + first_col);

    // P = exp(S − lse) and dS = P ∘ (dP − D): the same work in either order, which ptxas
    // schedules and spills differently at 255 registers (`TileConfig::probs_before_dp`).
    let value_cfg = comptime!(cfg.with_widths(cfg.value_dim, cfg.value_dim));
    let mut grads = if comptime!(cfg.probs_before_dp()) {
        #[unroll]
        for reg in 0..cfg.score_regs() {
            let slot = comptime!(cfg.score_slot(reg));
            let (_row, col) = T::score_position(reg, cfg);
            let row_lse = if comptime!(owns_keys) {
                stats[stats_at + (col - first_col)] * core::f32::consts::LOG2_E
            } else {
                owned_lse[slot]
            };
            probs[reg] = prob_of(probs[reg], row_lse, scale2, cfg);
        }
        let mut grads = if comptime!(cfg.dp_waits_for_probs()) {
            // dP's accumulators start at min(P, 0) = 0 (P is not negative; the minimum drops
            // a NaN): each of dP's MMAs then waits for the probabilities of its registers, so
            // that ptxas issues the exponentials between dP's MMAs, where it would otherwise
            // issue every product first and leave the tensor cores idle through them.
            let mut grads = Array::<f32>::new(cfg.score_regs());
            #[unroll]
            for reg in 0..cfg.score_regs() {
                grads[reg] = f32::min(probs[reg], 0.0);
            }
            T::add_scores(
                second_owned,
                second_stages,
                second_base,
                &mut grads,
                value_cfg,
            );
            grads
        } else {
            T::scores(second_owned, second_stages, second_base, value_cfg)
        };
        #[unroll]
        for reg in 0..cfg.score_regs() {
            let slot = comptime!(cfg.score_slot(reg));
            let (_row, col) = T::score_position(reg, cfg);
            let row_delta = if comptime!(owns_keys) {
                stats[stats_at + (col - first_col) + cfg.block_kv]
            } else {
                owned_delta[slot]
            };
            let p = probs[reg];
            grad_of(p, row_delta, &mut probs, &mut grads, reg, &keep, span, cfg);
        }
        grads
    } else {
        let mut grads = T::scores(second_owned, second_stages, second_base, value_cfg);
        #[unroll]
        for reg in 0..cfg.score_regs() {
            let slot = comptime!(cfg.score_slot(reg));
            let (_row, col) = T::score_position(reg, cfg);
            let (row_lse, row_delta) = if comptime!(owns_keys) {
                let at = stats_at + (col - first_col);
                (
                    stats[at] * core::f32::consts::LOG2_E,
                    stats[at + cfg.block_kv],
                )
            } else {
                (owned_lse[slot], owned_delta[slot])
            };
            let p = prob_of(probs[reg], row_lse, scale2, cfg);
            grad_of(p, row_delta, &mut probs, &mut grads, reg, &keep, span, cfg);
        }
        grads
    };

    let q_rows = comptime!(if owns_keys { cfg.block_kv } else { cfg.block_q });
    let kv_rows = comptime!(if owns_keys { cfg.block_q } else { cfg.block_kv });
    // Hidden pairs may have overflowed to inf above; select drops them without arithmetic.
    if block_needs_mask(span.band, q_start, q_rows, kv_start, kv_rows, cfg.mask) {
        #[unroll]
        for reg in 0..cfg.score_regs() {
            let (query, key) = pair_of::<E, T>(q_start, kv_start, reg, owns_keys, cfg);
            let visible = key_visible(span.band, query, key, cfg.mask);
            probs[reg] = select(visible, probs[reg], 0.0);
            grads[reg] = select(visible, grads[reg], 0.0);
        }
    }
    if comptime!(cfg.mask.tensor) {
        let allowed = mask_input_allows::<E, M, T>(
            mask, views.mask, span.band, q_start, kv_start, owns_keys, cfg,
        );
        #[unroll]
        for reg in 0..cfg.score_regs() {
            probs[reg] = select(allowed[reg], probs[reg], 0.0);
            grads[reg] = select(allowed[reg], grads[reg], 0.0);
        }
    }
    if comptime!(!owns_keys) {
        write_bias_grad::<E, T>(
            &grads, d_bias, batch, head, span.band, q_start, kv_start, cfg,
        );
    }
    if comptime!(cfg.softcap) {
        #[unroll]
        for reg in 0..cfg.score_regs() {
            grads[reg] *= slope[reg];
        }
    }

    let key_cfg = comptime!(cfg.with_widths(cfg.head_dim, cfg.head_dim));
    if comptime!(cfg.split > 1) {
        // Split planes (owning keys): P and dS go through `scratch` to the planes of the group.
        T::accumulate_split(
            &probs,
            &grads,
            scratch,
            second_stages,
            second_base,
            grad_second,
            first_stages,
            first_base,
            grad_first,
            cfg,
            key_cfg,
        );
    } else {
        if comptime!(owns_keys) {
            T::accumulate(&probs, second_stages, second_base, grad_second, cfg);
        }
        T::accumulate(&grads, first_stages, first_base, grad_first, key_cfg);
    }
    if accum.is_some() {
        T::add_transposed_product::<N>(
            &grads,
            first_owned,
            scratch,
            staging,
            accum,
            accum_base,
            staged_start,
            span.band.seq_q,
            comptime!(cfg.with_widths(cfg.head_dim, cfg.head_dim)),
        );
    }
}

/// `P = exp(scale · s − lse)` of one raw score `s`, with `scale2 = scale · log2(e)` and the
/// log-sum-exp in base 2.
#[cube]
fn prob_of(score: f32, row_lse: f32, scale2: f32, #[comptime] cfg: TileConfig) -> f32 {
    let p = exp2(score * scale2 - row_lse, cfg.tile);
    if comptime!(cfg.bias) {
        // A bias of -inf can hide a whole row (lse -inf): exp(-inf + inf) is NaN, not 0.
        select(row_lse >= f32::MIN, p, 0.0)
    } else {
        p
    }
}

/// Register `reg`'s `dS = p ∘ (dP − D)` into `grads` (which holds dP) and `p` into `probs`;
/// with dropout, `dS = p ∘ (dP ∘ Z − D)` and `probs` takes the dropped and rescaled `p ∘ Z`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn grad_of(
    p: f32,
    row_delta: f32,
    probs: &mut Array<f32>,
    grads: &mut Array<f32>,
    #[comptime] reg: usize,
    keep: &Array<bool>,
    span: Span,
    #[comptime] cfg: TileConfig,
) {
    if comptime!(cfg.dropout) {
        let kept = select(keep[reg], span.dropout.scale, 0.0);
        probs[reg] = p * kept;
        grads[reg] = p * (grads[reg] * kept - row_delta);
    } else {
        probs[reg] = p;
        grads[reg] = p * (grads[reg] - row_delta);
    }
}
