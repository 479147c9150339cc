//! The FlashAttention kernels: the algorithm (global / stage levels, online softmax, masking)
//! written once, over a matrix tile chosen at launch (tensor cores or portable FMAs).
//!
//! Imports go down only. Device side, bottom up: [`config`] (the comptime configuration, which
//! imports nothing of the kernels), `stage` (shared-memory staging), `tile` (the matrix tiles),
//! `band` (which keys a query sees), `inputs` (mask and bias inputs), `mask`, `softmax`,
//! `dropout`, `grid`, then the two passes, `forward` and `backward`. Host side: `tuning`
//! (environment overrides), `device` (the device's features), `tensors`, `pack`, and in each
//! pass a `plan` (what runs, decided on the host and unit-tested there) and a `launch` (what is
//! allocated and enqueued). `sources` creates the fused launches' kernels without a client,
//! for tools that compile them without the device.

mod backward;
mod band;
mod config;
mod device;
mod dropout;
mod forward;
mod grid;
mod inputs;
mod mask;
mod pack;
mod softmax;
#[doc(hidden)]
pub mod sources;
mod stage;
mod tensors;
mod tile;
mod tuning;

#[cfg(test)]
mod tests;

pub use backward::{Grads, backward, backward_packed, backward_support};
pub use config::{ScoreParams, TilePath};
pub use device::tensor_core_dim;
pub use forward::{forward, forward_packed, support, takes_warpgroup};
pub use tensors::{CachedKeys, KernelTensor, PackedRows, ScoreInputs};
