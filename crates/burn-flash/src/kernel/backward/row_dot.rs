//! Pre-pass of the backward: `D[i] = Σ_c dO[i, c] · O[i, c]` per query row, in f32.

use cubecl::prelude::*;

/// One unit per query row of `[batch, heads, seq_q, value_dim]` tensors; `delta` is
/// `[batch, heads, seq_q]`.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn row_dot<E: Float>(
    out: &Tensor<E>,
    d_out: &Tensor<E>,
    delta: &mut Tensor<f32>,
    #[comptime] value_dim: usize,
    #[define(E)] _dtype: StorageType,
) {
    let rows = delta.len();
    let row = ABSOLUTE_POS;
    if row < rows {
        let seq_q = out.shape(2);
        let heads = out.shape(1);
        let (bh, i) = (row / seq_q, row % seq_q);
        let (b, h) = (bh / heads, bh % heads);
        let o_base = b * out.stride(0) + h * out.stride(1) + i * out.stride(2);
        let g_base = b * d_out.stride(0) + h * d_out.stride(1) + i * d_out.stride(2);
        let mut sum = 0.0f32;
        for c in 0..value_dim {
            sum += f32::cast_from(out[o_base + c]) * f32::cast_from(d_out[g_base + c]);
        }
        delta[b * delta.stride(0) + h * delta.stride(1) + i * delta.stride(2)] = sum;
    }
}
