//! Compile-time configuration of the forward kernel: block shapes, plane layout, and the register
//! layout each tile uses. Every kernel specialises on one [`ForwardConfig`]; nothing else is
//! comptime.

use super::TilePath;

/// Rows of one MMA tile (m16n8k16).
pub const MMA_M: usize = 16;
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
    /// Query rows each plane owns (tensor-core tile, a multiple of [`MMA_M`]). Two m16 blocks
    /// per plane read every K/V fragment from shared memory once for 32 rows, halving the
    /// shared-memory traffic per MMA compared with one.
    pub plane_rows: usize,
    /// Tensor-core tile: keep the query block in shared memory and re-read its fragments for
    /// each KV block instead of holding them in registers (head dim 128, where registers would
    /// not hold Q beside the scores and the output accumulators).
    pub query_in_smem: bool,
    /// Skip KV blocks above the diagonal and mask the diagonal ones.
    pub causal: bool,
}

impl ForwardConfig {
    /// Tensor cores: `planes` planes of `plane_rows` query rows each, `block_kv`-row KV stages
    /// double-buffered.
    pub fn tensor_core(
        head_dim: usize,
        value_dim: usize,
        causal: bool,
        planes: usize,
        plane_rows: usize,
        block_kv: usize,
    ) -> Self {
        Self {
            tile: TilePath::TensorCore,
            head_dim,
            value_dim,
            block_q: planes * plane_rows,
            block_kv,
            planes,
            plane_rows,
            query_in_smem: head_dim > 64,
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
            plane_rows: 1,
            query_in_smem: false,
            causal,
        }
    }

    /// m16 row blocks each plane owns (tensor-core tile).
    pub fn m_tiles(&self) -> usize {
        self.plane_rows / MMA_M
    }

    /// Score registers each unit holds for one KV block.
    pub fn score_regs(&self) -> usize {
        match self.tile {
            TilePath::TensorCore => self.m_tiles() * self.block_kv / MMA_N * 4,
            TilePath::Portable => self.block_kv,
        }
    }

    /// Output accumulator registers each unit holds.
    pub fn out_regs(&self) -> usize {
        match self.tile {
            TilePath::TensorCore => self.m_tiles() * self.value_dim / MMA_N * 4,
            TilePath::Portable => self.value_dim,
        }
    }

    /// Query rows each unit keeps softmax statistics for.
    pub fn rows_per_unit(&self) -> usize {
        match self.tile {
            // An accumulator lane holds rows g and g + 8 of each m16 block.
            TilePath::TensorCore => 2 * self.m_tiles(),
            TilePath::Portable => 1,
        }
    }

    /// Which of the unit's rows score register `reg` belongs to.
    pub fn score_slot(&self, reg: usize) -> usize {
        self.slot(reg, self.block_kv)
    }

    /// Which of the unit's rows output register `reg` belongs to.
    pub fn out_slot(&self, reg: usize) -> usize {
        self.slot(reg, self.value_dim)
    }

    /// Row slot of register `reg` of an accumulator `cols` wide: registers are grouped by m16
    /// block, and within an m16n8 tile come as (c0, c1) of row g then (c2, c3) of row g + 8.
    fn slot(&self, reg: usize, cols: usize) -> usize {
        match self.tile {
            TilePath::TensorCore => reg / (cols / MMA_N * 4) * 2 + (reg / 2) % 2,
            TilePath::Portable => 0,
        }
    }

    /// Bytes of shared memory one cube uses.
    pub fn shared_bytes(&self, elem_size: usize) -> usize {
        let stages = match self.tile {
            TilePath::TensorCore => 2,
            TilePath::Portable => 1,
        };
        let query = if self.tile == TilePath::TensorCore {
            self.block_q * self.head_dim
        } else {
            0
        };
        (query + stages * self.block_kv * (self.head_dim + self.value_dim)) * elem_size
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

/// Block shapes of the backward launches (portable tile: one unit per owned row).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct BackwardConfig {
    /// Head dim of queries and keys.
    pub head_dim: usize,
    /// Head dim of values (and of the output).
    pub value_dim: usize,
    /// Rows each cube owns, one per unit: keys in the dK/dV launch, queries in the dQ launch.
    pub owned_rows: usize,
    /// Rows of the other side staged in shared memory per step.
    pub staged_rows: usize,
    /// Causal mask, aligned bottom-right.
    pub causal: bool,
}

impl BackwardConfig {
    /// 32 owned rows against 16 staged rows: the staged block fits 32 KiB of shared memory in
    /// f32 up to head dims of 128 + 128.
    pub fn portable(head_dim: usize, value_dim: usize, causal: bool) -> Self {
        Self {
            head_dim,
            value_dim,
            owned_rows: 32,
            staged_rows: 16,
            causal,
        }
    }

    /// Bytes of shared memory the larger of the two launches uses.
    pub fn shared_bytes(&self, elem_size: usize) -> usize {
        // dK/dV stages Q and dO rows plus two f32 statistics per row; dQ stages K and V rows.
        let staged = self.staged_rows * (self.head_dim + self.value_dim) * elem_size;
        staged + self.staged_rows * 2 * 4
    }
}
