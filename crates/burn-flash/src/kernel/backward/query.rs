//! dQ: one cube per block of queries, one unit per query. The unit keeps its query and output
//! gradient rows, its log-sum-exp and D in registers and walks the key blocks it can see,
//! staging K and V in shared memory.

use cubecl::prelude::*;

use crate::kernel::config::BackwardConfig;
use crate::kernel::mask::{key_visible, visible_key_end};
use crate::kernel::stage::load_block;

#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn query_grads<E: Float>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    d_out: &Tensor<E>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    d_q: &mut Tensor<E>,
    scale: f32,
    #[comptime] cfg: BackwardConfig,
    #[define(E)] _dtype: StorageType,
) {
    let batch = CUBE_POS_Z as usize;
    let head = CUBE_POS_Y as usize;
    let seq_q = q.shape(2);
    let seq_k = k.shape(2);
    let q_start = CUBE_POS_X as usize * cfg.owned_rows;
    let query = q_start + UNIT_POS as usize;
    let in_range = query < seq_q;
    let at = select(in_range, query, 0usize);

    let (d, dv) = (cfg.head_dim, cfg.value_dim);
    let q_base = batch * q.stride(0) + head * q.stride(1) + at * q.stride(2);
    let g_base = batch * d_out.stride(0) + head * d_out.stride(1) + at * d_out.stride(2);
    let mut query_row = Array::<f32>::new(d);
    let mut grad_q = Array::<f32>::new(d);
    #[unroll]
    for c in 0..d {
        query_row[c] = select(in_range, f32::cast_from(q[q_base + c]), 0.0);
        grad_q[c] = 0.0;
    }
    let mut grad_row = Array::<f32>::new(dv);
    #[unroll]
    for c in 0..dv {
        grad_row[c] = select(in_range, f32::cast_from(d_out[g_base + c]), 0.0);
    }
    let row_lse = lse[batch * lse.stride(0) + head * lse.stride(1) + at * lse.stride(2)];
    let row_delta = delta[batch * delta.stride(0) + head * delta.stride(1) + at * delta.stride(2)];

    let k_head = batch * k.stride(0) + head * k.stride(1);
    let v_head = batch * v.stride(0) + head * v.stride(1);
    let mut keys = SharedMemory::<E>::new(cfg.staged_rows * d);
    let mut values = SharedMemory::<E>::new(cfg.staged_rows * dv);
    let q_end = min(q_start + cfg.owned_rows, seq_q);
    let kv_end = visible_key_end(q_end, seq_q, seq_k, cfg.causal);
    for block in 0..kv_end.div_ceil(cfg.staged_rows) {
        let kv_start = block * cfg.staged_rows;
        sync_cube();
        load_block::<E>(
            k,
            k_head,
            kv_start,
            seq_k,
            &mut keys,
            cfg.staged_rows,
            d,
            cfg.owned_rows,
            false,
        );
        load_block::<E>(
            v,
            v_head,
            kv_start,
            seq_k,
            &mut values,
            cfg.staged_rows,
            dv,
            cfg.owned_rows,
            false,
        );
        sync_cube();

        // Not unrolled: the row loop is the long one, and its body is already d + dv wide.
        for r in 0..cfg.staged_rows {
            let visible = key_visible(query, kv_start + r, seq_q, seq_k, cfg.causal);
            let mut score = 0.0f32;
            #[unroll]
            for c in 0..d {
                score += query_row[c] * f32::cast_from(keys[r * d + c]);
            }
            let p = select(visible, (score * scale - row_lse).exp(), 0.0);
            let mut dp = 0.0f32;
            #[unroll]
            for c in 0..dv {
                dp += grad_row[c] * f32::cast_from(values[r * dv + c]);
            }
            let ds = p * (dp - row_delta);
            #[unroll]
            for c in 0..d {
                grad_q[c] += ds * f32::cast_from(keys[r * d + c]);
            }
        }
    }

    if in_range {
        let dq_base = batch * d_q.stride(0) + head * d_q.stride(1) + query * d_q.stride(2);
        #[unroll]
        for c in 0..d {
            d_q[dq_base + c] = E::cast_from(grad_q[c] * scale);
        }
    }
}
