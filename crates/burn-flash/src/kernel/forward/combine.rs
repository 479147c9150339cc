//! The forward's split keys merged ([`TileConfig::kv_split`](crate::kernel::config::TileConfig::kv_split)): split `s` of
//! a row left `o_s`, normalised over its keys, and `lse_s`; the row's log-sum-exp is
//! `lse = log Σ_s exp(lse_s)` and its output `Σ_s exp(lse_s − lse) · o_s`. A split that saw no
//! key has `lse_s = −inf` and weighs nothing; a row no split saw keeps output 0 and `−inf`.

use cubecl::prelude::*;

use crate::kernel::tensors::{F32, KernelTensor};

/// One unit per output element (`out`, `[b, h, sq, dv]`, contiguous) from the partial outputs
/// and log-sum-exps of the `splits` splits, head `split · h + head` of `partial_out` and
/// `partial_lse`. The split count is comptime so that both loops unroll: every split's load is
/// in flight at once rather than one L2 round trip per split (the merge sits on a decoding
/// step's critical path).
#[cube(launch_unchecked, address_type = "dynamic")]
fn combine_splits<E: Float>(
    partial_out: &Tensor<E>,
    partial_lse: &Tensor<f32>,
    out: &mut Tensor<E>,
    lse: &mut Tensor<f32>,
    neg_inf: f32,
    #[comptime] splits: usize,
    #[define(E)] _dtype: ElemType,
) {
    if ABSOLUTE_POS >= out.len() {
        terminate!();
    }
    let (heads, seq, dim) = (out.shape(1), out.shape(2), out.shape(3));
    let col = ABSOLUTE_POS % dim;
    let row = (ABSOLUTE_POS / dim) % seq;
    let head = (ABSOLUTE_POS / (dim * seq)) % heads;
    let batch = ABSOLUTE_POS / (dim * seq * heads);
    let lse_row =
        batch * partial_lse.stride(0) + head * partial_lse.stride(1) + row * partial_lse.stride(2);
    let lse_step = heads * partial_lse.stride(1);
    let out_at = batch * partial_out.stride(0)
        + head * partial_out.stride(1)
        + row * partial_out.stride(2)
        + col * partial_out.stride(3);
    let out_step = heads * partial_out.stride(1);

    let mut max = neg_inf;
    #[unroll]
    for split in 0..splits {
        let part = partial_lse[lse_row + split * lse_step];
        max = select(part > max, part, max);
    }
    // A row no split saw (`max = -inf`) weighs every split 0 instead of NaN.
    let seen = max > neg_inf;
    let shift = select(seen, max, 0.0);
    let mut sum = 0.0f32;
    let mut acc = 0.0f32;
    #[unroll]
    for split in 0..splits {
        let weight = (partial_lse[lse_row + split * lse_step] - shift).exp();
        sum += weight;
        acc += weight * f32::cast_from(partial_out[out_at + split * out_step]);
    }
    // `sum >= 1` where a split saw a key: the largest weight is exp(0).
    out[ABSOLUTE_POS] = E::cast_from(select(seen, acc / select(seen, sum, 1.0), 0.0));
    if col == 0 {
        let at = batch * lse.stride(0) + head * lse.stride(1) + row * lse.stride(2);
        lse[at] = select(seen, max + select(seen, sum, 1.0).ln(), neg_inf);
    }
}

/// Merge the splits' `partial_out` (`[b, splits · h, sq, dv]`) and `partial_lse`
/// (`[b, splits · h, sq]`, f32) into `out` (`[b, h, sq, dv]`, contiguous) and `lse`
/// (`[b, h, sq]`).
pub fn combine(
    partial_out: &KernelTensor,
    partial_lse: &KernelTensor,
    out: &KernelTensor,
    lse: &KernelTensor,
) {
    assert_eq!(partial_lse.dtype, F32);
    let units = out.meta.num_elements();
    let client = &out.client;
    let cube_dim = CubeDim::new(client, units);
    let cube_count = cubecl::calculate_cube_count_elemwise(client, units, cube_dim);
    let address = crate::kernel::tensors::address_type(&[partial_out, partial_lse, out, lse]);
    let splits = partial_lse.meta.shape()[1] / out.meta.shape()[1];
    // SAFETY: one unit per output element, guarded by the output's length; every other index is
    // bounded by the partial tensors' shapes, `splits · h` heads of the same (b, sq, dv).
    unsafe {
        combine_splits::launch_unchecked(
            client,
            cube_count,
            cube_dim,
            address,
            partial_out.clone().into_tensor_arg(),
            partial_lse.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            f32::NEG_INFINITY,
            splits,
            out.dtype,
        );
    }
}
