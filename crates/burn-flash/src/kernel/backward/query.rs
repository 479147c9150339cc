//! dQ: one cube per block of queries. The cube owns its queries and output gradients as tile
//! operands and walks the key blocks they can see, staging K and V.

use cubecl::prelude::*;

use super::walk::{walk, Span};
use crate::kernel::config::TileConfig;
use crate::kernel::mask::kv_blocks;
use crate::kernel::tile::AttentionTile;

#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn query_grads<E: Float, T: AttentionTile<E>>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    d_out: &Tensor<E>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    d_q: &mut Tensor<E>,
    scale: f32,
    #[comptime] cfg: TileConfig,
    #[define(E)] _dtype: StorageType,
) {
    let batch = CUBE_POS_Z as usize;
    let head = CUBE_POS_Y as usize;
    let span = Span {
        owned_start: CUBE_POS_X as usize * cfg.block_q,
        seq_q: q.shape(2),
        seq_k: k.shape(2),
        stat_base: batch * lse.stride(0) + head * lse.stride(1),
    };
    let query_cfg = comptime!(cfg.with_widths(cfg.head_dim, cfg.head_dim));
    let grad_cfg = comptime!(cfg.with_widths(cfg.value_dim, cfg.value_dim));

    let q_head = batch * q.stride(0) + head * q.stride(1);
    let g_head = batch * d_out.stride(0) + head * d_out.stride(1);
    let queries = T::load_query(q, q_head, span.owned_start, span.seq_q, cfg);
    let grads = T::load_query(d_out, g_head, span.owned_start, span.seq_q, grad_cfg);
    let mut grad_q = Array::<f32>::new(query_cfg.out_regs());
    #[unroll]
    for reg in 0..query_cfg.out_regs() {
        grad_q[reg] = 0.0;
    }
    // Owning queries, there is no second gradient.
    let mut unused = Array::<f32>::new(1usize);

    walk::<E, T>(
        &queries,
        &grads,
        k,
        batch * k.stride(0) + head * k.stride(1),
        v,
        batch * v.stride(0) + head * v.stride(1),
        0,
        kv_blocks(span.owned_start, span.seq_q, span.seq_k, cfg),
        lse,
        delta,
        span,
        scale,
        &mut grad_q,
        &mut unused,
        false,
        cfg,
    );

    let dq_head = batch * d_q.stride(0) + head * d_q.stride(1);
    #[unroll]
    for reg in 0..query_cfg.out_regs() {
        let (row, col) = T::out_position(reg, query_cfg);
        let query = span.owned_start + row;
        if query < span.seq_q {
            d_q[dq_head + query * d_q.stride(2) + col] = E::cast_from(grad_q[reg] * scale);
        }
    }
}
