//! The integration tests, in one binary: each test binary links Burn with its runtimes, and on
//! CI's two cores every extra one costs minutes of build.
//!
//! - `forward_wgpu`, `backward_wgpu`, `features_wgpu`: the portable tile on a wgpu device
//!   (lavapipe in CI), f32, against the f64 reference of `common`.
//! - `masks`: boolean masks and additive biases, on wgpu (f32, portable tile).
//! - `reliability`: random shapes and options, extreme logits, non-finite inputs and concurrent
//!   calls, on wgpu.

#[allow(dead_code)]
mod common;

mod backward_wgpu;
mod features_wgpu;
mod forward_wgpu;
mod masks;
mod reliability;
