//! Compile-time configuration of the forward kernel: block shapes, plane layout, and the register
//! layout each tile uses. Every kernel specialises on one [`ForwardConfig`]; nothing else is
//! comptime.

use super::TilePath;

/// Query rows a plane owns in the tensor-core tile (one m16 MMA row block).
pub const MMA_ROWS: usize = 16;
/// Columns of one MMA accumulator tile (m16n8k16).
pub const MMA_N: usize = 8;
/// Reduction depth of one MMA (m16n8k16).
pub const MMA_K: usize = 16;
/// Elements in one 16-byte shared-memory chunk of a 16-bit type: the unit of async copies,
/// of `ldmatrix` rows and of the swizzle.
pub const CHUNK: usize = 8;

/// Block shapes and layout of one forward launch.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct ForwardConfig {
    /// Which matrix tile computes the two products.
    pub tile: TilePath,
    /// Head dim of queries and keys.
    pub head_dim: usize,
    /// Head dim of values (and of the output).
    pub value_dim: usize,
    /// Query rows per cube.
    pub block_q: usize,
    /// Key/value rows per shared-memory stage.
    pub block_kv: usize,
    /// Planes per cube (tensor-core tile); the portable tile uses one unit per query row.
    pub planes: usize,
    /// Skip KV blocks above the diagonal and mask the diagonal ones.
    pub causal: bool,
}

impl ForwardConfig {
    /// Tensor cores: 4 planes of 16 rows, 64-row KV stages double-buffered.
    pub fn tensor_core(head_dim: usize, value_dim: usize, causal: bool) -> Self {
        let planes = 4;
        Self {
            tile: TilePath::TensorCore,
            head_dim,
            value_dim,
            block_q: planes * MMA_ROWS,
            block_kv: 64,
            planes,
            causal,
        }
    }

    /// Portable FMAs: one unit per query row; small KV stages fit 32 KiB of shared memory in f32.
    pub fn portable(head_dim: usize, value_dim: usize, causal: bool) -> Self {
        Self {
            tile: TilePath::Portable,
            head_dim,
            value_dim,
            block_q: 32,
            block_kv: 16,
            planes: 1,
            causal,
        }
    }

    /// Score registers each unit holds for one KV block.
    pub fn score_regs(&self) -> usize {
        match self.tile {
            TilePath::TensorCore => self.block_kv / MMA_N * 4,
            TilePath::Portable => self.block_kv,
        }
    }

    /// Output accumulator registers each unit holds.
    pub fn out_regs(&self) -> usize {
        match self.tile {
            TilePath::TensorCore => self.value_dim / MMA_N * 4,
            TilePath::Portable => self.value_dim,
        }
    }

    /// Query rows each unit keeps softmax statistics for.
    pub fn rows_per_unit(&self) -> usize {
        match self.tile {
            // An accumulator lane holds rows g and g + 8 of its m16 block.
            TilePath::TensorCore => 2,
            TilePath::Portable => 1,
        }
    }

    /// Which of the unit's rows score or output register `reg` belongs to.
    pub fn row_slot(&self, reg: usize) -> usize {
        match self.tile {
            // Accumulator registers come as (c0, c1) of row g then (c2, c3) of row g + 8.
            TilePath::TensorCore => (reg / 2) % 2,
            TilePath::Portable => 0,
        }
    }

    /// Whether shared-memory rows are stored with their 16-byte chunks XOR-swizzled by row, so
    /// that `ldmatrix` reads of 8 rows hit 8 different bank groups.
    pub fn swizzle(&self) -> bool {
        self.tile == TilePath::TensorCore
    }

    /// Units per cube.
    pub fn units(&self) -> usize {
        match self.tile {
            TilePath::TensorCore => 32 * self.planes,
            TilePath::Portable => self.block_q,
        }
    }
}
