//! The fused kernels as their launches would enqueue them, created without a client: for tools
//! that compile them without the device, as `examples/kernel_sources.rs` writes the CUDA C++ of
//! an H100's. Not part of the stable API.
//!
//! The launches' own plans decide (`ForwardPlan`, `BackwardPlan`), from the `DeviceCaps` of
//! the device's properties, for a [`Problem`] over contiguous tensors; each kernel is created by its `create_dummy_kernel`
//! with its arguments registered as its launch registers them, and compiles as the launch does,
//! unchecked. Nothing is allocated or run. Only the fused kernels are returned: the forward, the
//! dK/dV launch (each part of a split last wave) and dQ's own launch, not the small launches
//! around them (row dot, the tail's sum, the atomic dQ's conversion).

pub(super) mod base;

pub use base::{PlannedKernel, Problem, Target};

pub use super::backward::sources::backward;
pub use super::forward::sources::forward;
