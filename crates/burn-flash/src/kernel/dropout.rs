//! Dropout of the attention probabilities, regenerated wherever a probability is formed: a
//! counter-based generator gives every (batch, head, query, key) its keep decision from the seed
//! alone, so the forward, both backward launches and either tile agree without storing a mask.
//!
//! Query `i` and key `j` of flattened head `bh = batch · heads + head` read 16 bits of
//! `mix(c + head_key)`, with the counter `c = i · ⌈seq_k / 2⌉ + ⌊j / 2⌋` (wrapping u32): the
//! low half for even `j`, the high half for odd `j`. The pair is kept when those bits are below
//! `threshold = round((1 − p) · 2¹⁶)`, and kept probabilities are scaled by `2¹⁶ / threshold`, so
//! the output stays unbiased. `head_key = mix(seed_lo ^ mix(seed_hi ^ mix(bh)))`; `mix` is the
//! `lowbias32` integer hash (C. Wellons), a bijection, so counters of one head never share bits
//! while `seq_q · ⌈seq_k / 2⌉ ≤ 2³²`.

use cubecl::prelude::*;

use super::config::TileConfig;
use super::inputs::pair_of;
use super::tile::AttentionTile;

/// The seed of one call and the keep rule, for every head.
#[derive(CubeType, Clone, Copy)]
pub struct Dropout {
    seed_lo: u32,
    seed_hi: u32,
    threshold: u32,
    /// `threshold · 2¹⁶`: the high half of the bits is below `threshold` exactly when all 32
    /// bits are below this (a threshold below 2¹⁶, as every active dropout has).
    threshold_high: u32,
    heads: usize,
    pairs_per_row: u32,
    /// Factor of kept probabilities, `2¹⁶ / threshold`.
    pub scale: f32,
}

/// `lowbias32`: a bijective 32-bit hash whose output bits each flip with probability close to
/// 1/2 when any input bit flips.
#[cube]
fn mix(value: u32) -> u32 {
    let mut x = value;
    x ^= x >> 16u32;
    x *= 0x7feb_352du32;
    x ^= x >> 15u32;
    x *= 0x846c_a68bu32;
    x ^= x >> 16u32;
    x
}

#[cube]
impl Dropout {
    /// The generator of a call with `heads` query heads over `seq_k` keys; `threshold` in
    /// `1..=65536`.
    pub fn new(seed_lo: u32, seed_hi: u32, threshold: u32, heads: usize, seq_k: usize) -> Dropout {
        Dropout {
            seed_lo,
            seed_hi,
            threshold,
            threshold_high: threshold << 16u32,
            heads,
            pairs_per_row: u32::cast_from(seq_k.div_ceil(2)),
            scale: 65536.0 / f32::cast_from(threshold),
        }
    }

    /// The key of head `head` of batch `batch`.
    pub fn head_key(&self, batch: usize, head: usize) -> u32 {
        let bh = u32::cast_from(batch * self.heads + head);
        mix(self.seed_lo ^ mix(self.seed_hi ^ mix(bh)))
    }

    /// 32 random bits of keys `2·pair` and `2·pair + 1` for query `query`.
    fn bits(&self, head_key: u32, query: usize, pair: usize) -> u32 {
        mix(u32::cast_from(query) * self.pairs_per_row + u32::cast_from(pair) + head_key)
    }
}

/// Which of this unit's score registers dropout keeps in the block whose first query is
/// `q_start` and first key `kv_start`, for the head of `head_key` ([`Dropout::head_key`])
/// (`transposed`: the registers' rows are keys, as when a backward cube owns keys). One element
/// when the launch has no dropout. Registers `2r` and `2r + 1` hold neighbouring keys of one
/// query, the even one first (one hash serves both), or, transposed, neighbouring queries of one
/// key.
#[cube]
pub fn keep_mask<E: Float, T: AttentionTile<E>>(
    dropout: &Dropout,
    head_key: u32,
    q_start: usize,
    kv_start: usize,
    #[comptime] transposed: bool,
    #[comptime] cfg: TileConfig,
) -> Array<bool> {
    let mut keep = Array::<bool>::new(comptime!(if cfg.dropout { cfg.score_regs() } else { 1 }));
    if comptime!(cfg.dropout) {
        if comptime!(transposed) {
            #[unroll]
            for pair_reg in 0..cfg.score_regs() / 2 {
                let reg = comptime!(2 * pair_reg);
                let (query, key) = pair_of::<E, T>(q_start, kv_start, reg, transposed, cfg);
                let (next_query, _key) =
                    pair_of::<E, T>(q_start, kv_start, comptime!(reg + 1), transposed, cfg);
                // Both registers stand for one key: its half of each query's bits.
                let shift = u32::cast_from(key % 2) * 16u32;
                let first = (dropout.bits(head_key, query, key / 2) >> shift) & 0xFFFFu32;
                let second = (dropout.bits(head_key, next_query, key / 2) >> shift) & 0xFFFFu32;
                keep[reg] = first < dropout.threshold;
                keep[comptime!(reg + 1)] = second < dropout.threshold;
            }
        } else {
            // The counter is affine in the register's row and key pair: one product per block
            // at register 0, then per pair its offset from there (a constant key step the
            // compiler folds, and one of the unit's few row steps).
            let (query0, key0) = pair_of::<E, T>(q_start, kv_start, 0usize, transposed, cfg);
            let base = u32::cast_from(query0) * dropout.pairs_per_row
                + u32::cast_from(key0 / 2)
                + head_key;
            #[unroll]
            for pair_reg in 0..cfg.score_regs() / 2 {
                let reg = comptime!(2 * pair_reg);
                let (query, key) = pair_of::<E, T>(q_start, kv_start, reg, transposed, cfg);
                // Register 0's key is even, as every even register's is: the step halves exactly.
                let counter = base
                    + u32::cast_from(query - query0) * dropout.pairs_per_row
                    + u32::cast_from((key - key0) / 2);
                let bits = mix(counter);
                keep[reg] = (bits & 0xFFFFu32) < dropout.threshold;
                keep[comptime!(reg + 1)] = bits < dropout.threshold_high;
            }
        }
    }
    keep
}
