//! The FlashAttention kernels: the algorithm (global / stage levels, online softmax, masking)
//! written once, over a matrix tile chosen at launch (tensor cores or portable FMAs).

mod backward;
mod config;
mod dropout;
mod forward;
mod grid;
mod inputs;
mod launch;
mod mask;
mod pack;
mod softmax;
mod stage;
mod tile;

pub use backward::{backward, backward_support};
pub use config::ScoreParams;
pub use launch::{ScoreInputs, forward, support};

/// Which matrix tile a fused launch uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TilePath {
    /// Tensor cores: `MmaDefinition` m16n8k16 tiles (`ldmatrix` + `mma.sync`), f16/bf16 inputs
    /// with f32 accumulation, K/V staged by asynchronous copies (by tensor maps at head dims 64
    /// and 128 from SM90). CUDA, SM80 and newer.
    TensorCore,
    /// Portable register FMAs in f32, one unit per query row; any CubeCL runtime.
    Portable,
}
