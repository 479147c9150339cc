//! Masking of the scores: the band's bounds ([`band`](super::band)) element by element in the
//! blocks that cross them or the end of the keys (blocks wholly outside the band are never
//! visited), and a boolean mask input ([`inputs`](super::inputs)) in every block.

use cubecl::prelude::*;

use super::band::{Band, block_needs_mask, key_visible};
use super::config::TileConfig;
use super::inputs::{Broadcast, hide_staged, mask_input_allows, pair_of};
use super::tile::AttentionTile;

/// Set the scores of hidden pairs to `-inf`: the band's in blocks that cross it, the mask
/// input's (`at` its view of this (batch, head), or its block staged at `staged_base` in
/// `staged`) everywhere, unless it is packed ([`hide_packed`](super::inputs::hide_packed)).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn apply_mask<E: Float, M: Int, T: AttentionTile<E>>(
    scores: &mut Array<f32>,
    mask: ComptimeOption<&Tensor<M>>,
    staged: &ComptimeOption<Shared<[M]>>,
    staged_base: usize,
    at: Broadcast,
    band: Band,
    q_start: usize,
    kv_start: usize,
    neg_inf: f32,
    #[comptime] cfg: TileConfig,
) {
    if block_needs_mask(band, q_start, cfg.block_q, kv_start, cfg.block_kv, cfg.mask) {
        #[unroll]
        for reg in 0..cfg.score_regs() {
            let (query, key) = pair_of::<E, T>(q_start, kv_start, reg, false, cfg);
            scores[reg] = select(
                key_visible(band, query, key, cfg.mask),
                scores[reg],
                neg_inf,
            );
        }
    }
    // A packed mask is applied by `hide_packed`, from the words the block was classified by.
    if comptime!(cfg.mask.tensor && !cfg.mask.packed) {
        #[comptime]
        if let ComptimeOption::Some(stages) = staged {
            hide_staged::<E, M, T>(scores, stages, staged_base, neg_inf, cfg);
        } else {
            let allowed =
                mask_input_allows::<E, M, T>(mask, at, band, q_start, kv_start, false, cfg);
            #[unroll]
            for reg in 0..cfg.score_regs() {
                scores[reg] = select(allowed[reg], scores[reg], neg_inf);
            }
        }
    }
}
