//! dK and dV: one cube per block of keys, one unit per key. The unit keeps its key and value rows
//! and their gradients in registers and walks the query blocks that can see its block, staging
//! Q, dO, the log-sum-exp and D in shared memory.

use cubecl::prelude::*;

use crate::kernel::config::BackwardConfig;
use crate::kernel::mask::{first_seeing_query, key_visible};
use crate::kernel::stage::load_block;

#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn key_value_grads<E: Float>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    d_out: &Tensor<E>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    d_k: &mut Tensor<E>,
    d_v: &mut Tensor<E>,
    scale: f32,
    #[comptime] cfg: BackwardConfig,
    #[define(E)] _dtype: StorageType,
) {
    let batch = CUBE_POS_Z as usize;
    let head = CUBE_POS_Y as usize;
    let seq_q = q.shape(2);
    let seq_k = k.shape(2);
    let kv_start = CUBE_POS_X as usize * cfg.owned_rows;
    let key = kv_start + UNIT_POS as usize;
    let in_range = key < seq_k;

    let (d, dv) = (cfg.head_dim, cfg.value_dim);
    let k_base =
        batch * k.stride(0) + head * k.stride(1) + select(in_range, key, 0usize) * k.stride(2);
    let v_base =
        batch * v.stride(0) + head * v.stride(1) + select(in_range, key, 0usize) * v.stride(2);
    let mut key_row = Array::<f32>::new(d);
    let mut grad_k = Array::<f32>::new(d);
    #[unroll]
    for c in 0..d {
        key_row[c] = select(in_range, f32::cast_from(k[k_base + c]), 0.0);
        grad_k[c] = 0.0;
    }
    let mut value_row = Array::<f32>::new(dv);
    let mut grad_v = Array::<f32>::new(dv);
    #[unroll]
    for c in 0..dv {
        value_row[c] = select(in_range, f32::cast_from(v[v_base + c]), 0.0);
        grad_v[c] = 0.0;
    }

    let q_head = batch * q.stride(0) + head * q.stride(1);
    let g_head = batch * d_out.stride(0) + head * d_out.stride(1);
    let lse_head = batch * lse.stride(0) + head * lse.stride(1);
    let delta_head = batch * delta.stride(0) + head * delta.stride(1);
    let mut queries = SharedMemory::<E>::new(cfg.staged_rows * d);
    let mut grads = SharedMemory::<E>::new(cfg.staged_rows * dv);
    let mut row_lse = SharedMemory::<f32>::new(cfg.staged_rows);
    let mut row_delta = SharedMemory::<f32>::new(cfg.staged_rows);

    // Query blocks above the first query that sees this key block see none of it.
    let first = first_seeing_query(kv_start, seq_q, seq_k, cfg.causal) / cfg.staged_rows;
    let blocks = seq_q.div_ceil(cfg.staged_rows);
    for block in first..blocks {
        let q_start = block * cfg.staged_rows;
        sync_cube();
        load_block::<E>(
            q,
            q_head,
            q_start,
            seq_q,
            &mut queries,
            cfg.staged_rows,
            d,
            cfg.owned_rows,
            false,
        );
        load_block::<E>(
            d_out,
            g_head,
            q_start,
            seq_q,
            &mut grads,
            cfg.staged_rows,
            dv,
            cfg.owned_rows,
            false,
        );
        if UNIT_POS < cfg.staged_rows as u32 {
            let row = q_start + UNIT_POS as usize;
            let valid = row < seq_q;
            let at = select(valid, row, 0usize);
            row_lse[UNIT_POS as usize] = select(valid, lse[lse_head + at * lse.stride(2)], 0.0);
            row_delta[UNIT_POS as usize] =
                select(valid, delta[delta_head + at * delta.stride(2)], 0.0);
        }
        sync_cube();

        // Not unrolled: the row loop is the long one, and its body is already d + dv wide.
        for r in 0..cfg.staged_rows {
            let visible = key_visible(q_start + r, key, seq_q, seq_k, cfg.causal);
            let mut score = 0.0f32;
            #[unroll]
            for c in 0..d {
                score += f32::cast_from(queries[r * d + c]) * key_row[c];
            }
            // exp is evaluated for hidden keys too (it may overflow there); select drops it.
            let p = select(visible, (score * scale - row_lse[r]).exp(), 0.0);
            let mut dp = 0.0f32;
            #[unroll]
            for c in 0..dv {
                let g = f32::cast_from(grads[r * dv + c]);
                dp += g * value_row[c];
                grad_v[c] += p * g;
            }
            let ds = p * (dp - row_delta[r]);
            #[unroll]
            for c in 0..d {
                grad_k[c] += ds * f32::cast_from(queries[r * d + c]);
            }
        }
    }

    if in_range {
        let dk_base = batch * d_k.stride(0) + head * d_k.stride(1) + key * d_k.stride(2);
        let dv_base = batch * d_v.stride(0) + head * d_v.stride(1) + key * d_v.stride(2);
        #[unroll]
        for c in 0..d {
            d_k[dk_base + c] = E::cast_from(grad_k[c] * scale);
        }
        #[unroll]
        for c in 0..dv {
            d_v[dv_base + c] = E::cast_from(grad_v[c]);
        }
    }
}
