//! Dropout of the attention probabilities, regenerated wherever a probability is formed: a
//! counter-based generator gives every (batch, head, query, key) its keep decision from the seed
//! alone, so the forward, both backward launches and either tile agree without storing a mask.
//!
//! One 32-bit hash serves four keys of one query, one byte each: keys `16u + 2s`, `+ 1`, `+ 8`
//! and `+ 9` (`s < 4`) form group `4u + s`, and the bits `(j & 1) | (j >> 3 & 1) << 1` of key
//! `j` pick its byte. That group is what one tensor-core lane holds of a query row (columns
//! `2t`, `2t + 1` of two neighbouring n-tiles), so the forward and the dQ launch draw one hash
//! per four scores; the dK/dV launch, whose lanes hold keys `g` and `g + 8` of a query, one per
//! two. Query `i` of flattened head `bh = batch · heads + head` hashes the counter
//! `c = i · 4⌈seq_k / 16⌉ + group` (wrapping u32) as `mix(c + head_key)`; the pair is kept when
//! its byte is below `threshold = round((1 − p) · 2⁸)` (FlashAttention quantises the same way),
//! and kept probabilities are scaled by `2⁸ / threshold`, so the output stays unbiased.
//! `head_key = mix(seed_lo ^ mix(seed_hi ^ mix(bh)))`; `mix` is the `lowbias32` integer hash
//! (C. Wellons), a bijection, so counters of one head never share bits while
//! `seq_q · 4⌈seq_k / 16⌉ ≤ 2³²`.

use cubecl::prelude::*;

use super::config::TileConfig;
use super::inputs::pair_of;
use super::tile::AttentionTile;

/// The seed of one call and the keep rule, for every head.
#[derive(CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct Dropout {
    seed_lo: u32,
    seed_hi: u32,
    /// `threshold · 2²⁴`: a byte shifted to the top of a word is below `threshold` exactly when
    /// the word is below this (a threshold below 2⁸, as every active dropout has).
    threshold_top: u32,
    heads: usize,
    groups_per_row: u32,
    /// Factor of kept probabilities, `2⁸ / threshold`.
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

/// The group of key `key` within its query row.
#[cube]
fn group_of(key: usize) -> u32 {
    u32::cast_from((key >> 4) * 4 + ((key >> 1) & 3))
}

/// How far left the byte of key `key` must move to be a word's top byte.
#[cube]
fn byte_shift(key: usize) -> u32 {
    24u32 - 8u32 * u32::cast_from((key & 1) | ((key >> 3) & 1) << 1)
}

#[cube]
impl Dropout {
    /// The generator of a call with `heads` query heads over `seq_k` keys; `threshold` in
    /// `1..=256`.
    pub fn new(seed_lo: u32, seed_hi: u32, threshold: u32, heads: usize, seq_k: usize) -> Dropout {
        let scale = 256.0 / f32::cast_from(threshold);
        Dropout::with_scale(seed_lo, seed_hi, threshold, scale, heads, seq_k)
    }

    /// [`Dropout::new`] with the factor of kept probabilities given (`2⁸ / threshold`), for a
    /// kernel that must not divide (the Hopper forward: see
    /// [`reciprocal`](super::softmax::reciprocal)).
    pub fn with_scale(
        seed_lo: u32,
        seed_hi: u32,
        threshold: u32,
        scale: f32,
        heads: usize,
        seq_k: usize,
    ) -> Dropout {
        Dropout {
            seed_lo,
            seed_hi,
            threshold_top: threshold << 24u32,
            heads,
            groups_per_row: u32::cast_from(seq_k.div_ceil(16) * 4),
            scale,
        }
    }

    /// The key of head `head` of batch `batch`.
    pub fn head_key(&self, batch: usize, head: usize) -> u32 {
        let bh = u32::cast_from(batch * self.heads + head);
        mix(self.seed_lo ^ mix(self.seed_hi ^ mix(bh)))
    }
}

/// Which of this unit's score registers dropout keeps in the block whose first query is
/// `q_start` and first key `kv_start`, for the head of `head_key` ([`Dropout::head_key`])
/// (`transposed`: the registers' rows are keys, as when a backward cube owns keys). One element
/// when the launch has no dropout. Registers that share a group draw its hash once
/// ([`TileConfig::dropout_draw`]).
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
        let mut bits = Array::<u32>::new(cfg.score_regs());
        // Counters are affine in the register's row and group: one product per block at
        // register 0, then per drawing register its offset from there (compile-time steps the
        // compiler folds, and one of the unit's few row steps).
        let (query0, key0) = pair_of::<E, T>(q_start, kv_start, 0usize, transposed, cfg);
        let base = u32::cast_from(query0) * dropout.groups_per_row + group_of(key0) + head_key;
        #[unroll]
        for reg in 0..cfg.score_regs() {
            let draw = comptime!(cfg.dropout_draw(reg, transposed));
            if comptime!(draw.owner == reg) {
                let (query, key) = pair_of::<E, T>(q_start, kv_start, reg, transposed, cfg);
                // `key − key0` carries into no bit of `key0` below 4.
                let step = key - key0;
                let counter = base
                    + u32::cast_from(query - query0) * dropout.groups_per_row
                    + u32::cast_from((step >> 4) * 4 + ((step >> 1) & 3));
                bits[reg] = mix(counter);
            }
        }
        #[unroll]
        for reg in 0..cfg.score_regs() {
            let draw = comptime!(cfg.dropout_draw(reg, transposed));
            let word = bits[comptime!(draw.owner)];
            let top = match comptime!(draw.byte) {
                Some(byte) => word << comptime!(24 - 8 * byte as u32),
                None => {
                    let (_query, key) = pair_of::<E, T>(q_start, kv_start, reg, transposed, cfg);
                    word << byte_shift(key)
                }
            };
            keep[reg] = top < dropout.threshold_top;
        }
    }
    keep
}

/// The probabilities of the warpgroup forward's unit (`unit` of its warpgroup's 128) that
/// dropout keeps, the others zeroed: register `f` of `p` packs two 16-bit probabilities of row
/// `row + 8 · (f % 2)`, keys `key_start + 8⌊f / 2⌋ + 2 · (unit % 4)` and the next
/// ([`fragment_position`](super::tile::wgmma::fragment_position)), so registers `4u + h` and
/// `4u + 2 + h` hold one group of a row (`key_start` a multiple of 16): one hash each, its
/// four bytes in key order, each hash zeroing a half-word where its byte is not kept.
#[cube]
pub fn keep_probabilities(
    p: Vector<u32, Const<32>>,
    dropout: &Dropout,
    head_key: u32,
    row: usize,
    unit: usize,
    key_start: usize,
) -> Vector<u32, Const<32>> {
    let mut kept = p;
    let group = u32::cast_from(key_start / 4 + unit % 4) + head_key;
    #[unroll]
    for h in 0..2usize {
        let base = u32::cast_from(row + h * 8) * dropout.groups_per_row + group;
        #[unroll]
        for u in 0..8usize {
            let word = mix(base + comptime!(4 * u as u32));
            #[unroll]
            for half in 0..2usize {
                let f = comptime!(4 * u + 2 * half + h);
                let low = (word << comptime!(24 - 16 * half as u32)) < dropout.threshold_top;
                let high = (word << comptime!(16 - 16 * half as u32)) < dropout.threshold_top;
                let halves = select(low, 0xFFFFu32, 0u32) | select(high, 0xFFFF_0000u32, 0u32);
                kept.insert(f, kept.extract(f) & halves);
            }
        }
    }
    kept
}
