//! The dK/dV launch's last wave, spread over every cube slot. Its cubes own equal blocks of keys
//! and, without a band, walk the same number of query blocks, so a grid of `cubes` cubes on
//! `slots` slots runs `cubes / slots` full waves and then one of `cubes % slots` cubes, as long
//! as a full one, while the other slots idle: FlashAttention-2's benchmark shapes at head dim 64
//! launch 4096 cubes, 31 waves of 132 H100 slots and 4 cubes, 3 % of the launch on 4 SMs.
//!
//! Split, the launch runs twice on the same kernel ([`TailPart`](crate::kernel::config::TailPart)): the first `whole` cubes of the
//! grid order (owned block, then heads or batches, then the other) walk whole on the usual grid,
//! whose later cubes exit at once; then a grid of `pieces × (cubes - whole)` cubes walks each of
//! those cubes' walks in `pieces` pieces, each leaving its dK/dV sums, unscaled and in f32, in a
//! partial buffer, and [`finish_tail`] adds a cube's pieces in order (the same bits on every run)
//! and writes its rows of dK and dV. The whole cubes keep the unsplit kernel's code (their
//! positions from the grid, where a one-dimensional grid's divisions cost the d 64 single pass
//! two registers it does not have) and the pieces start as the last whole cubes end.

use cubecl::prelude::*;

use crate::kernel::config::TileConfig;
use crate::kernel::tile::AttentionTile;

/// Where the split starts, its pieces and the unsplit grid's extents, as launch scalars.
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub struct TailSplit {
    /// Cubes that walk whole, the first of the grid order.
    pub whole: u32,
    /// Pieces each later cube's walk is cut into.
    pub pieces: u32,
    /// Owned blocks per (batch, head): the grid order's fastest extent.
    pub blocks: u32,
    /// Its second extent: heads, or batches with `cfg.batch_inner`.
    pub rows: u32,
}

/// How [`plan`] splits a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TailPlan {
    pub whole: usize,
    pub split: usize,
    pub pieces: usize,
}

/// The split of `cubes` cubes of `steps` staged blocks each over `slots` cube slots: the last
/// partial wave's cubes, each in as many pieces as the free slots allow and no more than its
/// blocks. `None` where the cubes fill whole waves or the slots allow fewer than two pieces.
pub fn plan(cubes: usize, steps: usize, slots: usize) -> Option<TailPlan> {
    let split = cubes.checked_rem(slots).filter(|&split| split > 0)?;
    let pieces = (slots / split).min(steps);
    (pieces >= 2).then_some(TailPlan {
        whole: cubes - split,
        split,
        pieces,
    })
}

#[cube]
impl TailSplit {
    /// Whether this cube of a [`TailPart::Whole`](crate::kernel::config::TailPart::Whole) launch is one of the split ones.
    pub fn is_split(&self) -> bool {
        let linear = CUBE_POS_X + CUBE_COUNT_X * (CUBE_POS_Y + CUBE_COUNT_Y * CUBE_POS_Z);
        linear >= self.whole
    }

    /// (owned block, batch, head) of the cube at `linear` in the unsplit grid's order.
    fn position(&self, linear: u32, #[comptime] cfg: TileConfig) -> (usize, usize, usize) {
        let block = linear % self.blocks;
        let rest = linear / self.blocks;
        let (y, z) = (rest % self.rows, rest / self.rows);
        if comptime!(cfg.batch_inner) {
            (block as usize, y as usize, z as usize)
        } else {
            (block as usize, z as usize, y as usize)
        }
    }

    /// (owned block, batch, head) of the cube this piece belongs to ([`TailPart::Pieces`](crate::kernel::config::TailPart::Pieces): x
    /// is the piece, y the split cube).
    pub fn piece_owner(&self, #[comptime] cfg: TileConfig) -> (usize, usize, usize) {
        self.position(self.whole + CUBE_POS_Y, cfg)
    }

    /// (first step, steps) of this piece of a walk of `total` steps.
    pub fn piece_steps(&self, total: usize) -> (usize, usize) {
        let pieces = self.pieces as usize;
        let length = total.div_ceil(pieces);
        let first = min(CUBE_POS_X as usize * length, total);
        (first, min(length, total - first))
    }

    /// This piece's index in the partial buffer: the split cube's pieces in order.
    pub fn piece_id(&self) -> usize {
        (CUBE_POS_Y * self.pieces + CUBE_POS_X) as usize
    }
}

/// Write a piece's sums: `grad_k` (laid out as `cfg`'s accumulators at head dim `cfg.head_dim`)
/// and `grad_v` (`cfg.value_dim`) into piece `piece_id`'s `cfg.block_q` rows of `partials`, dK's
/// columns then dV's.
#[cube]
pub fn store_partials<E: Float, T: AttentionTile<E>>(
    grad_k: &Array<f32>,
    grad_v: &Array<f32>,
    partials: &mut Tensor<f32>,
    piece_id: usize,
    #[comptime] cfg: TileConfig,
) {
    let width = comptime!(cfg.head_dim + cfg.value_dim);
    let base = piece_id * comptime!(cfg.block_q * width);
    let key_cfg = comptime!(cfg.with_widths(cfg.head_dim, cfg.head_dim));
    #[unroll]
    for reg in 0..key_cfg.out_regs() {
        let (row, col) = T::out_position(reg, key_cfg);
        partials[base + row * width + col] = grad_k[reg];
    }
    #[unroll]
    for reg in 0..cfg.out_regs() {
        let (row, col) = T::out_position(reg, cfg);
        partials[base + row * width + cfg.head_dim + col] = grad_v[reg];
    }
}

/// dK and dV of the split cubes: one unit per (split cube, owned row, column of dK then dV) sums
/// the cube's `tail.pieces` partial rows in order and writes `scale` times it to dK, or it to dV,
/// skipping rows at or past `seq_k`.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn finish_tail<E: Float>(
    partials: &Tensor<f32>,
    d_k: &mut Tensor<E>,
    d_v: &mut Tensor<E>,
    tail: TailSplit,
    seq_k: usize,
    scale: f32,
    #[comptime] cfg: TileConfig,
    #[define(E)] _dtype: ElemType,
) {
    let width = comptime!(cfg.head_dim + cfg.value_dim);
    let rows = comptime!(cfg.block_q);
    let pieces = tail.pieces as usize;
    let id = ABSOLUTE_POS;
    let col = id % width;
    let row = (id / width) % rows;
    let cube = id / (width * rows);
    let (block, batch, head) = tail.position(tail.whole + cube as u32, cfg);
    let key = block * rows + row;
    if id < partials.len() / pieces && key < seq_k {
        let first = (cube * pieces * rows + row) * width + col;
        let mut sum = 0.0f32;
        for piece in 0..pieces {
            sum += partials[first + piece * comptime!(rows * width)];
        }
        if col < cfg.head_dim {
            let at = batch * d_k.stride(0) + head * d_k.stride(1) + key * d_k.stride(2) + col;
            d_k[at] = E::cast_from(sum * scale);
        } else {
            let at = batch * d_v.stride(0)
                + head * d_v.stride(1)
                + key * d_v.stride(2)
                + (col - cfg.head_dim);
            d_v[at] = E::cast_from(sum);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_only_a_partial_last_wave() {
        // FlashAttention-2's d 64 shapes: 4096 cubes of 32 blocks on 132 slots.
        assert_eq!(
            plan(4096, 32, 132),
            Some(TailPlan {
                whole: 4092,
                split: 4,
                pieces: 32
            })
        );
        // Whole waves, or too few free slots for two pieces each.
        assert_eq!(plan(264, 32, 132), None);
        assert_eq!(plan(2048, 64, 132), None);
        // One wave of a few cubes: every cube split, no more pieces than blocks.
        assert_eq!(
            plan(8, 3, 132),
            Some(TailPlan {
                whole: 0,
                split: 8,
                pieces: 3
            })
        );
        assert_eq!(plan(5, 1, 132), None);
        assert_eq!(plan(5, 10, 0), None);
    }
}
