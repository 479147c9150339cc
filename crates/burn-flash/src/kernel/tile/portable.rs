//! The portable tile: one unit per query row, both products as f32 register FMAs reading the
//! staged K/V rows from shared memory. Runs wherever CubeCL runs (wgpu, lavapipe included).

use cubecl::prelude::*;

use super::base::{AttentionTile, zero_scores};
use crate::kernel::config::{CHUNK, TileConfig};
use crate::kernel::stage::{input_offset, stage_offset};

/// Register-FMA tile; unit `UNIT_POS` owns query row `UNIT_POS` of the block.
pub struct PortableTile;

#[cube]
impl<E: Float> AttentionTile<E> for PortableTile {
    type Query = Array<f32>;
    type StagedFactor = f32;

    fn load_query(
        q: &Tensor<E>,
        head_base: usize,
        row_stride: usize,
        q_start: usize,
        seq_q: usize,
        #[comptime] cfg: TileConfig,
    ) -> Array<f32> {
        let mut query = Array::<f32>::new(cfg.head_dim);
        let row = q_start + UNIT_POS as usize;
        let in_bounds = row < seq_q;
        let start = head_base + select(in_bounds, row * row_stride, 0usize);
        #[unroll]
        for c in 0..cfg.head_dim {
            query[c] = select(in_bounds, f32::cast_from(q[start + c]), 0.0);
        }
        query
    }

    fn load_query_pair(
        first: &Tensor<E>,
        first_base: usize,
        second: &Tensor<E>,
        second_base: usize,
        start: usize,
        seq: usize,
        #[comptime] cfg: TileConfig,
        #[comptime] second_cfg: TileConfig,
    ) -> (Array<f32>, Array<f32>) {
        (
            Self::load_query(first, first_base, first.stride(2), start, seq, cfg),
            Self::load_query(
                second,
                second_base,
                second.stride(2),
                start,
                seq,
                second_cfg,
            ),
        )
    }

    fn scores(
        query: &Array<f32>,
        keys: &Shared<[E]>,
        stage_base: usize,
        #[comptime] cfg: TileConfig,
    ) -> Array<f32> {
        let mut scores = zero_scores(cfg);
        Self::add_scores(query, keys, stage_base, &mut scores, cfg);
        scores
    }

    fn add_scores(
        query: &Array<f32>,
        keys: &Shared<[E]>,
        stage_base: usize,
        scores: &mut Array<f32>,
        #[comptime] cfg: TileConfig,
    ) {
        // The depth loop stays rolled: fully unrolled products make shader compilers (lavapipe's
        // LLVM above all) take minutes on the backward's four of them.
        for c in 0..cfg.head_dim {
            let q = query[c];
            #[unroll]
            for j in 0..cfg.block_kv {
                let key = keys[stage_base + stage_offset(j, c, cfg.head_dim, false)];
                scores[j] += q * f32::cast_from(key);
            }
        }
    }

    fn accumulate(
        probs: &Array<f32>,
        values: &Shared<[E]>,
        stage_base: usize,
        out: &mut Array<f32>,
        #[comptime] cfg: TileConfig,
    ) {
        for c in 0..cfg.value_dim {
            let mut acc = 0.0f32;
            #[unroll]
            for j in 0..cfg.block_kv {
                let value = values[stage_base + stage_offset(j, c, cfg.value_dim, false)];
                acc += probs[j] * f32::cast_from(value);
            }
            out[c] += acc;
        }
    }

    fn accumulate_split(
        probs: &Array<f32>,
        grads: &Array<f32>,
        _exchange: &mut Shared<[E]>,
        second: &Shared<[E]>,
        second_base: usize,
        second_out: &mut Array<f32>,
        first: &Shared<[E]>,
        first_base: usize,
        first_out: &mut Array<f32>,
        #[comptime] cfg: TileConfig,
        #[comptime] key_cfg: TileConfig,
    ) {
        // A portable unit owns whole rows: nothing to exchange (its configs never split).
        Self::accumulate(probs, second, second_base, second_out, cfg);
        Self::accumulate(grads, first, first_base, first_out, key_cfg);
    }

    fn add_transposed_product<N: Size>(
        grads: &Array<f32>,
        owned: &Array<f32>,
        _scratch: &mut Shared<[E]>,
        _staging: &mut Shared<[f32]>,
        accum: &mut ComptimeOption<&mut Tensor<Atomic<Vector<f32, N>>>>,
        accum_base: usize,
        staged_start: usize,
        staged_len: usize,
        #[comptime] cfg: TileConfig,
    ) {
        // Each unit adds its own row's outer product: no exchange between units, one atomic per
        // (unit, staged row, column), so `N` is 1. Owned rows past the end are zeros and add
        // nothing.
        let row_stride = cfg.head_dim;
        #[comptime]
        if let ComptimeOption::Some(accum) = accum {
            #[unroll]
            for j in 0..cfg.block_kv {
                let row = staged_start + j;
                if row < staged_len {
                    let base = accum_base + row * row_stride;
                    for c in 0..cfg.head_dim {
                        accum[base + c].fetch_add(Vector::new(grads[j] * owned[c]));
                    }
                }
            }
        }
    }

    fn staged_factor(factor: f32, #[comptime] _cfg: TileConfig) -> f32 {
        factor
    }

    fn add_staged(
        scores: &mut Array<f32>,
        stage: &Shared<[E]>,
        base: usize,
        factor: &f32,
        #[comptime] cfg: TileConfig,
    ) {
        #[unroll]
        for reg in 0..cfg.score_regs() {
            let at = base + input_offset(UNIT_POS as usize, reg, CHUNK, cfg);
            scores[reg] += f32::cast_from(stage[at]) * *factor;
        }
    }

    fn score_position(#[comptime] reg: usize, #[comptime] _cfg: TileConfig) -> (usize, usize) {
        (UNIT_POS as usize, reg)
    }

    fn store_owned(
        _owned: &mut Array<f32>,
        regs: &Array<f32>,
        factor: f32,
        out: &mut Tensor<E>,
        head_base: usize,
        row_stride: usize,
        start: usize,
        seq: usize,
        #[comptime] cfg: TileConfig,
    ) {
        let row = start + UNIT_POS as usize;
        if row < seq {
            let at = head_base + row * row_stride;
            #[unroll]
            for col in 0..cfg.value_dim {
                out[at + col] = E::cast_from(regs[col] * factor);
            }
        }
    }

    fn out_position(#[comptime] reg: usize, #[comptime] _cfg: TileConfig) -> (usize, usize) {
        (UNIT_POS as usize, reg)
    }

    fn slot_row(#[comptime] _slot: usize, #[comptime] _cfg: TileConfig) -> usize {
        UNIT_POS as usize
    }

    fn writes_row_stats() -> bool {
        UNIT_POS < CUBE_DIM
    }

    fn row_max(value: f32) -> f32 {
        value
    }

    fn row_sum(value: f32) -> f32 {
        value
    }

    fn any_unit(flag: bool) -> bool {
        flag
    }
}
