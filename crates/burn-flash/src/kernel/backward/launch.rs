//! Launch of the backward: which inputs it takes, the grids, the gradient tensors.

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
use cubecl::prelude::*;

use super::key_value::key_value_grads;
use super::query::query_grads;
use super::row_dot::row_dot;
use crate::kernel::config::BackwardConfig;
use crate::kernel::launch::output;

/// Largest head dim the portable backward unrolls (its rows live in registers).
const MAX_DIM: usize = 128;

/// Whether the fused backward can run inputs of this dtype and head dims on this client.
pub fn backward_support<R: CubeRuntime>(
    client: &ComputeClient<R>,
    dtype: DType,
    head_dim: usize,
    value_dim: usize,
) -> Result<(), String> {
    let props = client.properties();
    if !matches!(dtype, DType::F16 | DType::BF16 | DType::F32) {
        return Err(format!("dtype {dtype:?} is not f16, bf16 or f32"));
    }
    if head_dim == 0 || value_dim == 0 || head_dim > MAX_DIM || value_dim > MAX_DIM {
        return Err(format!(
            "the backward supports head dims 1..={MAX_DIM} (q/k {head_dim}, v {value_dim})"
        ));
    }
    let shared = BackwardConfig::portable(head_dim, value_dim, false).shared_bytes(dtype.size());
    if shared > props.hardware.max_shared_memory_size {
        return Err(format!(
            "the backward needs {shared} bytes of shared memory, the device has {}",
            props.hardware.max_shared_memory_size
        ));
    }
    Ok(())
}

/// Gradients `(dq, dk, dv)` of the fused attention, from its inputs, its output `out`, its
/// log-sum-exp `lse` (`[b, h, sq]`, f32) and the output gradient `d_out`. Inputs as for
/// [`forward`](crate::kernel::forward), accepted by [`backward_support`].
#[allow(clippy::too_many_arguments)]
pub fn backward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    d_out: CubeTensor<R>,
    causal: bool,
    scale: f32,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let [q, k, v, out, lse, d_out] = [q, k, v, out, lse, d_out].map(into_contiguous);
    let dims = q.meta.shape().clone();
    let (batch, heads, seq_q, head_dim) = (dims[0], dims[1], dims[2], dims[3]);
    let (seq_k, value_dim) = (k.meta.shape()[2], v.meta.shape()[3]);
    let client = q.client.clone();
    let dtype = q.dtype;

    let d_q = output(&q, Shape::new([batch, heads, seq_q, head_dim]), dtype);
    let d_k = output(&q, Shape::new([batch, heads, seq_k, head_dim]), dtype);
    let d_v = output(&q, Shape::new([batch, heads, seq_k, value_dim]), dtype);
    let delta = output(&q, Shape::new([batch, heads, seq_q]), DType::F32);
    if batch * heads == 0 {
        return (d_q, d_k, d_v);
    }
    let cfg = BackwardConfig::portable(head_dim, value_dim, causal);
    let address = [&q, &k, &v, &out, &d_out, &d_q, &d_k, &d_v]
        .iter()
        .map(|t| t.required_address_type())
        .max()
        .unwrap_or_default();
    let elem: StorageType = dtype.into();
    let owned = CubeDim::new_1d(cfg.owned_rows as u32);
    let grid = |rows: usize| {
        CubeCount::Static(
            rows.div_ceil(cfg.owned_rows) as u32,
            heads as u32,
            batch as u32,
        )
    };

    // SAFETY: shapes and strides were validated by the caller; every index the kernels form is
    // bounded by the tensors' shapes (rows past the ends are clamped or skipped).
    unsafe {
        let rows = batch * heads * seq_q;
        if rows > 0 {
            let cube_dim = CubeDim::new(&client, rows);
            row_dot::launch_unchecked(
                &client,
                cubecl::calculate_cube_count_elemwise(&client, rows, cube_dim),
                cube_dim,
                address,
                out.into_tensor_arg(),
                d_out.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                value_dim,
                elem,
            );
        }
        if seq_k > 0 {
            key_value_grads::launch_unchecked(
                &client,
                grid(seq_k),
                owned,
                address,
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                d_out.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                d_k.clone().into_tensor_arg(),
                d_v.clone().into_tensor_arg(),
                scale,
                cfg,
                elem,
            );
        }
        if seq_q > 0 {
            query_grads::launch_unchecked(
                &client,
                grid(seq_q),
                owned,
                address,
                q.into_tensor_arg(),
                k.into_tensor_arg(),
                v.into_tensor_arg(),
                d_out.into_tensor_arg(),
                lse.into_tensor_arg(),
                delta.into_tensor_arg(),
                d_q.clone().into_tensor_arg(),
                scale,
                cfg,
                elem,
            );
        }
    }
    (d_q, d_k, d_v)
}
