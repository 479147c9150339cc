//! Tile level: the two matrix products of attention on one unit's registers. The algorithm
//! (`forward`, `softmax`, `mask`) is written once against [`AttentionTile`]; the tensor-core tile
//! runs on CUDA, the portable tile on any CubeCL runtime.

mod base;
mod mma;
mod portable;

pub use base::AttentionTile;
pub use mma::MmaTile;
pub use portable::PortableTile;
