//! The launch grid: one cube per (row block, head, batch), row blocks stepped through first (last
//! first where a right bound makes the last ones the longest, [`row_block`]). Heads
//! come before batches by default, so that the cubes of one sequence run together and a mask shared
//! by its heads is read from memory about once. A bias shared by the batch (`[1, h, sq, sk]`, a
//! relative-position bias) turns that around: read once per sequence, it would be the largest
//! traffic of the launch (2·sk bytes a query row, against 8·d bytes of q, k, v and output in 16-bit
//! types), so batches come first and the cubes of one head in every sequence run together, reading
//! each of its blocks while another holds it in L2.

use std::sync::OnceLock;

use cubecl::prelude::*;

use super::config::{TileConfig, TilePath};
use super::tuning::flag_override;

/// (batch, head) of this cube.
#[cube]
pub fn batch_and_head(#[comptime] cfg: TileConfig) -> (usize, usize) {
    if comptime!(cfg.batch_inner) {
        (CUBE_POS_Y as usize, CUBE_POS_Z as usize)
    } else {
        (CUBE_POS_Z as usize, CUBE_POS_Y as usize)
    }
}

/// This cube's row block. Where a right bound (causal) gives the last row blocks the most keys,
/// the grid's x runs backwards: cubes are dispatched in launch order, so the longest of each
/// (batch, head) start first and the last wave ends with the shortest, instead of a few long
/// cubes running on while the other SMs idle (longest processing time first).
// The cube's built-ins are placeholder constants on the host side, where rustc would evaluate
// the subtraction; in the kernel `CUBE_POS_X < CUBE_COUNT_X`.
#[allow(arithmetic_overflow)]
#[cube]
pub fn row_block(#[comptime] cfg: TileConfig) -> usize {
    if comptime!(cfg.mask.right) {
        (CUBE_COUNT_X - 1 - CUBE_POS_X) as usize
    } else {
        CUBE_POS_X as usize
    }
}

/// This cube's row block and its split of the row block's keys, of `splits`, where the keys
/// are split ([`TileConfig::kv_split`](super::config::TileConfig::kv_split)): the grid's x runs
/// over (row block, split).
#[cube]
pub fn block_and_split(splits: usize, #[comptime] cfg: TileConfig) -> (usize, usize) {
    let x = row_block(cfg);
    (x / splits, x % splits)
}

/// The key blocks a cube walks: `first`, `first + step`, … below `end`.
#[derive(CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct BlockWalk {
    pub first: usize,
    pub end: usize,
    pub step: usize,
}

#[cube]
impl BlockWalk {
    /// Every block of `[first, end)`.
    pub fn all(first: usize, end: usize) -> BlockWalk {
        BlockWalk {
            first,
            end,
            step: 1usize,
        }
    }

    /// Split `split`'s share of the blocks of `[first, end)` among `splits`. `strided`: every
    /// `splits`-th block from `first + split` (shares one block apart in length at most), so
    /// that a row block's splits read neighbouring blocks at the same time (dense caches:
    /// 1.5–2.3 % faster than runs on four decoding shapes of the H200, within 0.3 % on the
    /// others). Else consecutive runs, the last ones shorter or empty (paged caches, where a
    /// run's blocks share pages: strided, two rows at 16k keys ran 7 % slower).
    pub fn split(
        first: usize,
        end: usize,
        split: usize,
        splits: usize,
        #[comptime] strided: bool,
    ) -> BlockWalk {
        if comptime!(strided) {
            BlockWalk {
                first: first + split,
                end,
                step: splits,
            }
        } else {
            let per = (end - first).div_ceil(splits);
            let start = min(first + split * per, end);
            BlockWalk {
                first: start,
                end: min(start + per, end),
                step: 1usize,
            }
        }
    }

    /// How many blocks the walk visits.
    pub fn count(&self) -> usize {
        select(
            self.first < self.end,
            (self.end - min(self.first, self.end)).div_ceil(self.step),
            0usize,
        )
    }

    /// The walk's `i`-th block.
    pub fn block(&self, i: usize) -> usize {
        self.first + i * self.step
    }

    /// The walk's last block, or where it visits none, the last block before `end` (0 when
    /// `end` is 0): the index reads ahead are clamped to, in range either way.
    pub fn last(&self) -> usize {
        let count = self.count();
        select(
            count > 0,
            self.first + (max(count, 1) - 1) * self.step,
            max(self.end, 1) - 1,
        )
    }
}

/// The cubes of a launch over `rows` rows per (batch, head) in blocks of `cfg.block_q`, each
/// block's keys split across `splits` cubes (1 without
/// [`TileConfig::kv_split`](super::config::TileConfig::kv_split)).
pub fn cube_count(
    cfg: &TileConfig,
    rows: usize,
    heads: usize,
    batch: usize,
    splits: usize,
) -> CubeCount {
    let blocks = (rows.div_ceil(cfg.block_q) * splits) as u32;
    if cfg.batch_inner {
        CubeCount::Static(blocks, batch as u32, heads as u32)
    } else {
        CubeCount::Static(blocks, heads as u32, batch as u32)
    }
}

/// Units of a cube: one plane per `cfg.planes` (tensor cores), one unit per owned row (portable).
pub fn cube_dim(cfg: &TileConfig) -> CubeDim {
    match cfg.tile {
        TilePath::TensorCore => CubeDim::new_2d(32, cfg.planes as u32),
        TilePath::Portable => CubeDim::new_1d(cfg.units() as u32),
    }
}

/// Whether batches come before heads: where a bias (of batch size `bias_batch`) is shared by a
/// batch of several sequences. `BURN_FLASH_BATCH_INNER=0|1` decides instead (tuning runs).
pub fn batch_inner(bias_batch: Option<usize>, batch: usize) -> bool {
    static OVERRIDE: OnceLock<Option<bool>> = OnceLock::new();
    let forced = OVERRIDE.get_or_init(|| flag_override("BURN_FLASH_BATCH_INNER"));
    forced.unwrap_or(batch > 1 && bias_batch == Some(1))
}
