//! Fused FlashAttention for [Burn](https://burn.dev), written in CubeCL: the crate on Burn 0.23
//! and CubeCL 0.12, ported layer by layer (`next/README.md` says what is ported).
//!
//! This layer holds the kernels and their launches on CubeCL tensors ([`kernel`]): the
//! forward, which writes the output and the per-row log-sum-exp, and the backward, which
//! recomputes the probabilities from them. [`FlashAttentionOptions`] describes one call.
//!
//! # Example
//!
//! ```no_run
//! use burn_flash::kernel::{KernelTensor, ScoreInputs, ScoreParams, forward};
//! use burn_flash::FlashAttentionOptions;
//!
//! let client = cubecl::Device::Wgpu(Default::default()).client();
//! let shape = [1, 2, 128, 64]; // [batch, heads, seq, head_dim]
//! let values: Vec<f32> = (0..2 * 128 * 64).map(|i| (i % 7) as f32 * 0.1).collect();
//! let tensor = || KernelTensor::from_f32(&client, &values, shape);
//! let params = ScoreParams::new(&FlashAttentionOptions::causal(), 2, 64, 128, 128);
//! let (out, lse) = forward(tensor(), tensor(), tensor(), ScoreInputs::new(None, None), params);
//! assert_eq!(out.meta.shape()[..], [1, 2, 128, 64]);
//! ```
#![warn(missing_docs)]

pub mod kernel;
mod options;
pub mod testing;

pub use options::{AttentionDropout, AttentionWindow, FlashAttentionOptions, alibi_slopes};
