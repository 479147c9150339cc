//! The forward: FlashAttention-2's loop over key/value blocks with an online softmax
//! ([`kernel`]), planned on the host ([`plan`]) and launched ([`launch`]), the key blocks split
//! across cubes where asked and merged by [`combine`], the keys of a paged cache found through
//! its block table ([`pages`]), the tensors' dims and strides passed as scalars ([`layout`]);
//! [`sources`] creates its kernel as the launch would, without a client. On Hopper, where
//! asked, plain and causal attention take [`warpgroup`]'s kernel on warpgroup products instead.

pub(crate) mod combine;
mod kernel;
pub(crate) mod launch;
mod layout;
mod pages;
pub(crate) mod plan;
pub(super) mod sources;
#[cfg(feature = "cuda")]
pub(crate) mod warpgroup;

pub use launch::{forward, forward_packed, support, takes_warpgroup};
