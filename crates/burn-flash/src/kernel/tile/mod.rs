//! Tile level: the two matrix products of attention on one unit's registers. The algorithm
//! (`forward`, `softmax`, `mask`) is written once against [`AttentionTile`]; the tensor-core tile
//! runs on CUDA, the portable tile on any CubeCL runtime. [`wgmma`] holds Hopper's warpgroup
//! products, which the warpgroup forward issues directly.

mod base;
mod mma;
mod portable;
#[cfg(feature = "cuda")]
pub mod wgmma;

pub use base::AttentionTile;
pub use mma::MmaTile;
pub use portable::PortableTile;
