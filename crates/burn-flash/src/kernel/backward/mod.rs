//! The FlashAttention-2 backward: gradients of `O = softmax(scale · Q·Kᵀ) · V` recomputed block by
//! block from Q, K, V, the output and the forward's per-row log-sum-exp, never materialising the
//! `seq_q × seq_k` matrices.
//!
//! With `P = exp(scale · S − lse)` and `D = rowsum(dO ∘ O)`:
//! `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P ∘ (dP − D)`, `dK = scale · dSᵀ·Q`, `dQ = scale · dS·K`;
//! an additive bias's gradient is `dS` itself.
//!
//! Three launches: [`row_dot`] computes `D`; [`key_value`] owns a block of keys per cube and walks
//! the query blocks that see it (dK, dV); [`query`] owns a block of queries per cube and walks the
//! key blocks it sees (dQ), which needs no atomics and gives the same bits on every run (the
//! default). With `deterministic` off, [`key_value`] instead adds each block's dQ to an f32
//! accumulator with atomics (FlashAttention-2's scheme) and [`query`] only scales and casts it.
//! Both main launches share [`walk`], which runs on the forward's tile
//! ([`AttentionTile`](crate::kernel::tile::AttentionTile)): tensor cores on CUDA, portable FMAs elsewhere.
//! Where the dK/dV launch's last wave would leave most SMs idle, [`tail`] spreads its cubes'
//! walks over them. [`plan`] decides all of this on the host; [`launch`] enqueues it, and
//! [`sources`] creates the fused launches' kernels as it would, without a client.

mod key_value;
mod launch;
mod plan;
mod query;
mod row_dot;
pub(super) mod sources;
mod tail;
mod walk;
#[cfg(feature = "cuda")]
pub(crate) mod warpgroup;

pub use launch::{Grads, backward, backward_packed, backward_support};
