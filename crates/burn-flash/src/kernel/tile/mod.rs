//! Tile level: the two matrix products of attention on one unit's registers. The algorithm
//! (`forward`, `softmax`, `mask`) is written once against [`AttentionTile`]; the tensor-core tile
//! runs on CUDA, the portable tile on any CubeCL runtime.

mod base;
mod mma;
mod portable;
// The Hopper tile's instruction, checked on its own until the tile uses it.
#[cfg(all(test, feature = "cuda"))]
mod wgmma;

pub use base::AttentionTile;
pub use mma::MmaTile;
pub use portable::PortableTile;
