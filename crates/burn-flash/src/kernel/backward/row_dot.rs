//! Pre-pass of the backward: `D[i] = Σ_c dO[i, c] · O[i, c]` per query row, in f32.

use cubecl::prelude::*;

/// `group` neighbouring units of a plane share one query row of `[batch, heads, seq_q,
/// value_dim]` tensors (`delta` is `[batch, heads, seq_q]`, contiguous). Each reads vectors of `N`
/// elements, `group` vectors apart, so that a plane's loads cover whole rows contiguously
/// instead of one element of 32 rows; the group then sums its partial dots by shuffles (a
/// power of two up to the plane size; 1 reads whole rows per unit, with no plane operation).
/// `vectors` is `value_dim / N`.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn row_dot<E: Float, N: Size>(
    out: &Tensor<Vector<E, N>>,
    d_out: &Tensor<Vector<E, N>>,
    delta: &mut Tensor<f32>,
    #[comptime] vectors: usize,
    #[comptime] group: usize,
    #[define(E)] _dtype: ElemType,
) {
    let width = out.vector_size();
    let rows = delta.len();
    let row = ABSOLUTE_POS / group;
    let part = ABSOLUTE_POS % group;
    let mut sum = 0.0f32;
    if row < rows {
        let seq_q = out.shape(2);
        let heads = out.shape(1);
        let (bh, i) = (row / seq_q, row % seq_q);
        let (b, h) = (bh / heads, bh % heads);
        let o_base = (b * out.stride(0) + h * out.stride(1) + i * out.stride(2)) / width;
        let g_base = (b * d_out.stride(0) + h * d_out.stride(1) + i * d_out.stride(2)) / width;
        let mut at = part;
        while at < vectors {
            let product = Vector::<f32, N>::cast_from(out[o_base + at])
                * Vector::<f32, N>::cast_from(d_out[g_base + at]);
            #[unroll]
            for e in 0..width {
                sum += product.extract(e);
            }
            at += group;
        }
    }
    // Units past the last row still take part: the shuffles need the whole group.
    #[unroll]
    for step in 0..comptime!(group.trailing_zeros()) {
        sum += plane_shuffle_xor(sum, comptime!((group >> (step + 1)) as u32));
    }
    if row < rows && part == 0 {
        delta[row] = sum;
    }
}
