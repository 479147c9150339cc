//! The forward: FlashAttention-2's loop over key/value blocks with an online softmax
//! ([`kernel`]), planned on the host ([`plan`]) and launched ([`launch`]).

mod kernel;
mod launch;
pub(crate) mod plan;

pub use launch::{forward, support};
