//! Fused FlashAttention for [Burn](https://burn.dev), written in CubeCL.
//!
//! [`flash_attention`] computes `softmax(scale · Q·Kᵀ [+ mask]) · V` on
//! `[batch, heads, seq, head_dim]` tensors in one kernel, without materialising the
//! `seq_q × seq_k` score matrix, with the same conventions as
//! `burn::tensor::module::attention`. [`FlashAttentionOptions`] adds to plain attention the
//! causal mask, sliding windows ([`AttentionWindow`]) and the softcap of Gemma-2; `k` and `v`
//! may have fewer heads than `q` (grouped-query and multi-query attention), read in place. It runs
//! on the devices of Burn's CubeCL backends (`Device::wgpu`, `Device::cuda`, …), with or without
//! autodiff ([`FlashAttentionBackend`]).
//!
//! On CUDA (SM80 and newer) with f16/bf16 inputs the kernel uses the tensor cores; elsewhere a
//! portable tile of register FMAs ([`TilePath`]). Inputs the kernel cannot run (a head dim or a
//! device it has no tile for) take Burn's unfused `attention_fallback`, and the reason is logged
//! with `log::warn!`; [`flash_attention_plan`] tells which path a call takes. Invalid inputs
//! (mismatched shapes, devices or dtypes) are refused with a [`FlashAttentionError`].
//!
//! On an autodiff device the fused forward records one node (saving q, k, v, the output and its
//! log-sum-exp) whose backward runs the fused backward kernels on the same tile as the forward,
//! so training never materialises the score matrix either.
//!
//! Batches of sequences of different lengths packed along the rows (FlashAttention-2's varlen
//! layout) run through [`try_flash_attention_varlen`], forward and backward fused, with no work
//! on padding; decoding against a key/value cache through [`KvCache`] and [`PagedKvCache`].
//!
//! The kernels and their launches on CubeCL tensors, without Burn, are in [`kernel`].
//!
//! # Example
//!
//! ```no_run
//! use burn::tensor::{Device, Distribution, Tensor};
//! use burn_flash::{flash_attention, flash_attention_plan, FlashAttentionOptions};
//!
//! let device = Device::wgpu(Default::default());
//! let [q, k, v] = [0, 1, 2].map(|_| {
//!     Tensor::<4>::random([4, 16, 1024, 64], Distribution::Normal(0.0, 1.0), &device)
//! });
//! let options = FlashAttentionOptions::causal().with_sliding_window(255);
//! println!("{}", flash_attention_plan(&q, &k, &v, options).unwrap());
//! let out = flash_attention(q, k, v, options); // [4, 16, 1024, 64]
//! ```
#![warn(missing_docs)]

mod api;
mod backend;
mod cache;
mod backends {
    mod autodiff;
    mod cube;
    mod fusion;
}
mod error;
pub mod kernel;
mod lengths;
pub mod nn;
mod options;
mod paged;
mod support;
#[doc(hidden)]
pub mod testing;
mod varlen;

pub use api::{
    AttentionMask, FlashAttentionPlan, flash_attention, flash_attention_masked,
    flash_attention_plan, flash_attention_with_lse, try_flash_attention,
    try_flash_attention_masked,
};
pub use backend::{
    BiasGrad, FlashAttentionBackend, FlashAttentionForward, FlashAttentionGrads,
    FlashAttentionProblem, KeyCache, PackedStarts, ScoreInputs,
};
pub use cache::KvCache;
pub use error::FlashAttentionError;
pub use kernel::TilePath;
pub use lengths::{try_flash_attention_paged, try_flash_attention_with_lengths};
pub use options::{
    AttentionDropout, AttentionWindow, CausalAlignment, FlashAttentionOptions, alibi_slopes,
};
pub use paged::PagedKvCache;
pub use support::{flash_attention_backward_support, flash_attention_support};
pub use varlen::{PackedSequences, try_flash_attention_varlen};
