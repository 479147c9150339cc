//! The integration tests, in one binary: each test binary links Burn with both runtimes, and on
//! CI's two cores every extra one costs minutes of build.
//!
//! - `forward_wgpu`, `backward_wgpu`, `features_wgpu`, `nn_wgpu`: the portable tile on
//!   `burn::backend::Wgpu` (lavapipe in CI), f32, against the f64 reference of `common`.
//! - `masks`: boolean masks and additive biases, on wgpu (f32, portable tile) and, with feature
//!   `cuda`, on the tensor-core tile.
//! - `forward_cuda`, `backward_cuda` (feature `cuda`): the tensor-core tile on the FA2 shapes with
//!   DESIGN.md's 2× rule; each test prints `skipping: no CUDA device (...)` and passes without a
//!   GPU, unless `BURN_FLASH_REQUIRE_CUDA=1`.

#[allow(dead_code)]
mod common;

mod backward_cuda;
mod backward_wgpu;
mod features_wgpu;
mod forward_cuda;
mod forward_wgpu;
mod masks;
mod nn_wgpu;
mod reliability;
