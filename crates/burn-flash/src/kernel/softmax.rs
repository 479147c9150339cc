//! Online softmax on the score registers (FlashAttention-2): running row max and row sum, the
//! softmax scale (times log2 e) folded into one fused multiply-add before a base-2 exponential,
//! the output accumulators rescaled in registers when the max moves far enough to matter. Each
//! unit keeps its own part of the row sum; the parts are combined once, at the end.
//!
//! `-inf` arrives as a runtime argument (`neg_inf`): WGSL has no literal for it.

use cubecl::prelude::*;

use super::config::{TileConfig, TilePath};
use super::tile::AttentionTile;

/// 2^x. On the tensor-core path (CUDA) one `ex2.approx.ftz.f32`, by inline PTX: CubeCL 0.12's
/// C++ backend prints `powf` and `exp` as the accurate library calls and passes NVRTC no fast-math
/// flag, and the accurate `powf` is some twenty instructions per score. `exp`'s multiply by
/// log2 e moves into the score's fused multiply-add. Denormal results flush to zero, which a
/// softmax term of under 2^-126 of the row's largest cannot notice. Elsewhere `exp(x · ln 2)`,
/// since WGSL's `pow` goes through a general-purpose helper.
#[cube]
pub fn exp2(x: f32, #[comptime] tile: TilePath) -> f32 {
    if comptime!(tile == TilePath::TensorCore) {
        let out: f32;
        gpu_asm!(
            "ex2.approx.ftz.f32 {out}, {x};",
            out = out(_) out,
            x = in(_) x,
            options(pure, nomem),
        );
        out
    } else {
        (x * core::f32::consts::LN_2).exp()
    }
}

/// `1 / x` to within an ulp (`rcp.approx.ftz`, CUDA only). The correctly rounded division
/// calls a slow-path subroutine, and CubeCL has the driver assemble its PTX as relocatable code
/// (`cuLinkAddData`), where any call makes ptxas serialise every `wgmma` of the kernel ("C7509:
/// wgmma.mma_async instructions are serialized due to the presence of Extern calls"): the
/// Hopper forward divides by it.
#[cube]
pub fn reciprocal(x: f32) -> f32 {
    let r: f32;
    gpu_asm!("rcp.approx.ftz.f32 {r}, {x};", r = out(_) r, x = in(_) x);
    r
}

/// Running statistics of the unit's rows, the max in the units the softmax scale multiplies
/// (raw scores; softcapped ones without the cap's outer factor where the scale carries it).
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
    // A bounded max is the softcap's bound, 1 in the units of `tanh(inner · s)`.
    let first = select(cfg.bounded_max, 1.0f32, neg_inf);
    #[unroll]
    for r in 0..rows {
        max[r] = first;
        sum[r] = 0.0;
    }
    RowStats { max, sum }
}

/// Softcap in raw score units: `s ↦ outer · tanh(inner · s)` with `inner = scale / cap` and
/// `outer = cap / scale`, so that `scale · s ↦ cap · tanh(scale · s / cap)` (Gemma-2's
/// softcap of the scaled logits) and everything downstream, which multiplies by `scale`, is
/// unchanged.
#[derive(CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct Softcap {
    pub inner: f32,
    pub outer: f32,
}

#[cube]
impl Softcap {
    /// The softcap `cap` for scores scaled by `scale` (`cap` unused unless the config asks).
    pub fn new(scale: f32, cap: f32) -> Softcap {
        Softcap {
            inner: scale / cap,
            outer: cap / scale,
        }
    }
}

/// Apply the softcap to the first `regs` raw scores. With `outer_in_scale`, leave them
/// `tanh(inner · s)`: the caller has folded `outer` into the softmax scale.
#[cube]
pub fn softcap_scores(
    scores: &mut Array<f32>,
    cap: Softcap,
    #[comptime] regs: usize,
    #[comptime] outer_in_scale: bool,
) {
    #[unroll]
    for reg in 0..regs {
        let capped = (scores[reg] * cap.inner).tanh();
        scores[reg] = if comptime!(outer_in_scale) {
            capped
        } else {
            cap.outer * capped
        };
    }
}

/// How far (in base-2 units of the scaled scores) a row's running max may lag behind its true
/// max before the output accumulators are rescaled: probabilities then reach at most e^8 ≈ 3·10³
/// before normalisation, far inside the range of f32 accumulators and of f16/bf16 P.
const RESCALE_SLACK: f32 = 8.0 * core::f32::consts::LOG2_E;

/// Turn the raw scores of one KV block into unnormalised probabilities exp(scale·(s − m)) =
/// 2^(scale·log2 e·(s − m)) in place and update the row statistics. Masked scores are `-inf` and
/// become exactly 0.
///
/// The running max `m` moves, and the output accumulators and row sums are rescaled by
/// exp(scale·(m_old − m_new)), only when some row of the unit's plane saw its max grow by more
/// than [`RESCALE_SLACK`]; otherwise the block is exponentiated against the old max. The result
/// is exact either way (numerator, sum and log-sum-exp all use the same `m`), and after the first
/// few blocks the rescale of every output register is usually skipped. With
/// [`TileConfig::bounded_max`], `m` is the softcap's bound throughout.
#[cube]
pub fn online_update<E: Float, T: AttentionTile<E>>(
    scores: &mut Array<f32>,
    stats: &mut RowStats,
    out: &mut Array<f32>,
    scale: f32,
    neg_inf: f32,
    #[comptime] cfg: TileConfig,
) {
    let scale2 = scale * core::f32::consts::LOG2_E;
    if comptime!(cfg.bounded_max) {
        // The max is the softcap's bound (`stats.max` = 1): no reduction, no rescale, and each
        // score's `tanh` feeds its `exp2` directly.
        let mut shift = Array::<f32>::new(comptime!(cfg.rows_per_unit()));
        #[unroll]
        for r in 0..cfg.rows_per_unit() {
            shift[r] = scale2;
        }
        exponentiate(scores, stats, scale2, &shift, cfg);
    } else {
        online_update_running::<E, T>(scores, stats, out, scale2, neg_inf, cfg);
    }
}

/// Every score `s` of the block becomes `2^(scale2 · s − shift[row])`, added to its row's sum.
#[cube]
fn exponentiate(
    scores: &mut Array<f32>,
    stats: &mut RowStats,
    scale2: f32,
    shift: &Array<f32>,
    #[comptime] cfg: TileConfig,
) {
    #[unroll]
    for reg in 0..cfg.score_regs() {
        let slot = comptime!(cfg.score_slot(reg));
        let p = exp2(scores[reg] * scale2 - shift[slot], cfg.tile);
        scores[reg] = p;
        stats.sum[slot] += p;
    }
}

/// [`online_update`] against the running row max (`scale2` = scale · log2 e).
#[cube]
fn online_update_running<E: Float, T: AttentionTile<E>>(
    scores: &mut Array<f32>,
    stats: &mut RowStats,
    out: &mut Array<f32>,
    scale2: f32,
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
    let mut grown = false;
    #[unroll]
    for r in 0..rows {
        block_max[r] = T::row_max(block_max[r]);
        // -inf (no visible key yet) never exceeds -inf: such a row waits for a visible key.
        grown = grown || block_max[r] * scale2 > stats.max[r] * scale2 + RESCALE_SLACK;
    }

    if T::any_unit(grown) {
        let mut alpha = Array::<f32>::new(rows);
        #[unroll]
        for r in 0..rows {
            // A row that has seen no visible key keeps a max of -inf: shift by 0 so that its
            // masked scores give exp(-inf) = 0 instead of NaN.
            let shift = select(block_max[r] == neg_inf, 0.0, block_max[r] * scale2);
            alpha[r] = exp2(stats.max[r] * scale2 - shift, cfg.tile);
            stats.max[r] = block_max[r];
            stats.sum[r] *= alpha[r];
        }
        #[unroll]
        for reg in 0..cfg.out_regs() {
            let slot = comptime!(cfg.out_slot(reg));
            out[reg] *= alpha[slot];
        }
    }

    let mut shift = Array::<f32>::new(rows);
    #[unroll]
    for r in 0..rows {
        shift[r] = select(stats.max[r] == neg_inf, 0.0, stats.max[r] * scale2);
    }
    exponentiate(scores, stats, scale2, &shift, cfg);
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
