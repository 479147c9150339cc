//! dK and dV: one cube per block of keys. The cube owns its keys and values as tile operands and
//! walks the query blocks that can see them, staging Q and dO.

use cubecl::prelude::*;

use super::walk::{walk, Span};
use crate::kernel::config::TileConfig;
use crate::kernel::mask::first_seeing_query;
use crate::kernel::tile::AttentionTile;

#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn key_value_grads<E: Float, T: AttentionTile<E>>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    d_out: &Tensor<E>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    d_k: &mut Tensor<E>,
    d_v: &mut Tensor<E>,
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
    let key_cfg = comptime!(cfg.with_widths(cfg.head_dim, cfg.head_dim));
    let value_cfg = comptime!(cfg.with_widths(cfg.value_dim, cfg.value_dim));

    let k_head = batch * k.stride(0) + head * k.stride(1);
    let v_head = batch * v.stride(0) + head * v.stride(1);
    let keys = T::load_query(k, k_head, span.owned_start, span.seq_k, cfg);
    let values = T::load_query(v, v_head, span.owned_start, span.seq_k, value_cfg);
    let mut grad_k = Array::<f32>::new(key_cfg.out_regs());
    #[unroll]
    for reg in 0..key_cfg.out_regs() {
        grad_k[reg] = 0.0;
    }
    let mut grad_v = Array::<f32>::new(cfg.out_regs());
    #[unroll]
    for reg in 0..cfg.out_regs() {
        grad_v[reg] = 0.0;
    }

    // Query blocks above the first query that sees this key block see none of it.
    let first_query = first_seeing_query(span.owned_start, span.seq_q, span.seq_k, cfg.causal);
    walk::<E, T>(
        &keys,
        &values,
        q,
        batch * q.stride(0) + head * q.stride(1),
        d_out,
        batch * d_out.stride(0) + head * d_out.stride(1),
        first_query / cfg.block_kv,
        span.seq_q.div_ceil(cfg.block_kv),
        lse,
        delta,
        span,
        scale,
        &mut grad_k,
        &mut grad_v,
        true,
        cfg,
    );

    let dk_head = batch * d_k.stride(0) + head * d_k.stride(1);
    #[unroll]
    for reg in 0..key_cfg.out_regs() {
        let (row, col) = T::out_position(reg, key_cfg);
        let key = span.owned_start + row;
        if key < span.seq_k {
            d_k[dk_head + key * d_k.stride(2) + col] = E::cast_from(grad_k[reg] * scale);
        }
    }
    let dv_head = batch * d_v.stride(0) + head * d_v.stride(1);
    #[unroll]
    for reg in 0..cfg.out_regs() {
        let (row, col) = T::out_position(reg, cfg);
        let key = span.owned_start + row;
        if key < span.seq_k {
            d_v[dv_head + key * d_v.stride(2) + col] = E::cast_from(grad_v[reg]);
        }
    }
}
