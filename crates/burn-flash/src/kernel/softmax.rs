//! Online softmax on the score registers (FlashAttention-2): running row max and row sum, the
//! softmax scale folded into one fused multiply-add before `exp`, the output accumulators rescaled
//! in registers when the max moves. Each unit keeps its own part of the row sum; the parts are
//! combined once, at the end.
//!
//! `-inf` arrives as a runtime argument (`neg_inf`): WGSL has no literal for it.

use cubecl::prelude::*;

use super::config::TileConfig;
use super::tile::AttentionTile;

/// Running statistics of the unit's rows, in raw (unscaled) score units for the max.
#[derive(CubeType)]
pub struct RowStats {
    /// Largest raw score seen so far per row (`-inf` while no key was visible).
    pub max: Array<f32>,
    /// This unit's part of Σ exp(scale·(s − max)) per row.
    pub sum: Array<f32>,
}

#[cube]
pub fn init_stats(neg_inf: f32, #[comptime] cfg: TileConfig) -> RowStats {
    let rows = comptime!(cfg.rows_per_unit());
    let mut max = Array::<f32>::new(rows);
    let mut sum = Array::<f32>::new(rows);
    #[unroll]
    for r in 0..rows {
        max[r] = neg_inf;
        sum[r] = 0.0;
    }
    RowStats { max, sum }
}

/// Turn the raw scores of one KV block into unnormalised probabilities exp(scale·(s − m)) in
/// place, update the row statistics, and rescale the output accumulators by exp(scale·(m_old −
/// m_new)). Masked scores are `-inf` and become exactly 0.
#[cube]
pub fn online_update<E: Float, T: AttentionTile<E>>(
    scores: &mut Array<f32>,
    stats: &mut RowStats,
    out: &mut Array<f32>,
    scale: f32,
    neg_inf: f32,
    #[comptime] cfg: TileConfig,
) {
    let rows = comptime!(cfg.rows_per_unit());
    let mut block_max = Array::<f32>::new(rows);
    #[unroll]
    for r in 0..rows {
        block_max[r] = stats.max[r];
    }
    #[unroll]
    for reg in 0..cfg.score_regs() {
        let slot = comptime!(cfg.score_slot(reg));
        block_max[slot] = max(block_max[slot], scores[reg]);
    }

    let mut shift = Array::<f32>::new(rows);
    let mut alpha = Array::<f32>::new(rows);
    #[unroll]
    for r in 0..rows {
        let new_max = T::row_max(block_max[r]);
        // A row that has seen no visible key keeps a max of -inf: shift by 0 so that its
        // masked scores give exp(-inf) = 0 instead of NaN.
        shift[r] = select(new_max == neg_inf, 0.0, new_max * scale);
        alpha[r] = (stats.max[r] * scale - shift[r]).exp();
        stats.max[r] = new_max;
        stats.sum[r] *= alpha[r];
    }

    #[unroll]
    for reg in 0..cfg.score_regs() {
        let slot = comptime!(cfg.score_slot(reg));
        let p = (scores[reg] * scale - shift[slot]).exp();
        scores[reg] = p;
        stats.sum[slot] += p;
    }
    #[unroll]
    for reg in 0..cfg.out_regs() {
        let slot = comptime!(cfg.out_slot(reg));
        out[reg] *= alpha[slot];
    }
}

/// Per row of the unit: the factor that normalises the output (0 for a row with no visible key,
/// whose output is then 0) and the natural log-sum-exp of the scaled scores (`-inf` for such a
/// row).
#[cube]
pub fn finish<E: Float, T: AttentionTile<E>>(
    stats: &RowStats,
    scale: f32,
    neg_inf: f32,
    #[comptime] cfg: TileConfig,
) -> (Array<f32>, Array<f32>) {
    let rows = comptime!(cfg.rows_per_unit());
    let mut inv_sum = Array::<f32>::new(rows);
    let mut lse = Array::<f32>::new(rows);
    #[unroll]
    for r in 0..rows {
        let total = T::row_sum(stats.sum[r]);
        let visible = total > 0.0;
        inv_sum[r] = select(visible, 1.0 / total, 0.0);
        lse[r] = select(visible, stats.max[r] * scale + total.ln(), neg_inf);
    }
    (inv_sum, lse)
}
