//! The integration tests, in one binary: each test binary links Burn with its runtimes, and on
//! CI's two cores every extra one costs minutes of build.
//!
//! - `forward_wgpu`, `backward_wgpu`, `features_wgpu`, `nn_wgpu`: the portable tile on a wgpu
//!   device (lavapipe in CI), f32, against the f64 reference of `common`.
//! - `cache`: `KvCache` decoding runs, on wgpu and, with feature `cuda`, on the tensor-core
//!   tile.
//! - `lengths`: `try_flash_attention_with_lengths` on each of its paths, on wgpu and, with
//!   feature `cuda`, on the tensor-core tile.
//! - `varlen`: `try_flash_attention_varlen` on packed sequences of different lengths, on each
//!   of its paths, gradients included, on wgpu and, with feature `cuda`, on the tensor-core
//!   tile.
//! - `masks`: boolean masks and additive biases, on wgpu (f32, portable tile) and, with feature
//!   `cuda`, on the tensor-core tile.
//! - `reliability`: random shapes and options, extreme logits, non-finite inputs and concurrent
//!   calls, on wgpu and, with feature `cuda`, on the tensor-core tile, with long sequences and
//!   tensors of more than 2^31 elements.
//! - `forward_cuda`, `backward_cuda` (feature `cuda`): the tensor-core tile on the FA2 shapes with
//!   DESIGN.md's 2× rule.
//!
//! Without a CUDA device each CUDA test prints `skipping: no CUDA device (...)` and passes, unless
//! `BURN_FLASH_REQUIRE_CUDA` is set.

#[allow(dead_code)]
mod common;

mod backward_cuda;
mod backward_wgpu;
mod cache;
mod features_wgpu;
mod forward_cuda;
mod forward_wgpu;
mod lengths;
mod masks;
mod nn_wgpu;
mod reliability;
mod varlen;
