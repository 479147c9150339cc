//! The forward's split keys merged ([`TileConfig::kv_split`](crate::kernel::config::TileConfig::kv_split)): split `s` of
//! a row left `o_s`, normalised over its keys, and `lse_s`; the row's log-sum-exp is
//! `lse = log Σ_s exp(lse_s)` and its output `Σ_s exp(lse_s − lse) · o_s`. A split that saw no
//! key has `lse_s = −inf` and weighs nothing; a row no split saw keeps output 0 and `−inf`.
//!
//! The merge sits on a decoding step's critical path, after a launch of a few µs: one cube per
//! row, its planes taking the splits between them, so that every partial load of the row is in
//! flight at once (one round trip to L2) and the exponentials are taken once per split rather
//! than once per output element.

use cubecl::prelude::*;

use crate::kernel::tensors::{F32, KernelTensor};

/// Units per plane of the merge: a plane's lanes take consecutive columns.
const LANES: usize = 32;
/// Most planes of one merge cube; each takes `splits / planes` of the splits.
const MOST_PLANES: usize = 8;

/// One cube per output row (`CUBE_POS` = (row, head, batch) of `out`, `[b, h, sq, dv]`),
/// `planes` planes of [`LANES`] units: plane `p` sums splits `p, p + planes, …` over columns
/// `lane + LANES · j`, `j < dv / LANES` rounded up, from head `split · h + head` of
/// `partial_out` and `partial_lse`. Every tensor is contiguous, and its dims come as scalars
/// (`heads`, `rows`) or comptime (`splits`, `dim`): CubeCL reads `shape` and `stride` from a
/// metadata buffer in global memory, a round trip the loads would wait for.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
fn combine_splits<E: Float>(
    partial_out: &Tensor<E>,
    partial_lse: &Tensor<f32>,
    out: &mut Tensor<E>,
    lse: &mut Tensor<f32>,
    heads: usize,
    rows: usize,
    neg_inf: f32,
    #[comptime] splits: usize,
    #[comptime] planes: usize,
    #[comptime] dim: usize,
    #[define(E)] _dtype: ElemType,
) {
    let (row, head, batch) = (
        CUBE_POS_X as usize,
        CUBE_POS_Y as usize,
        CUBE_POS_Z as usize,
    );
    let (lane, plane) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    let unit = plane * LANES + lane;
    let cols = comptime!(dim.div_ceil(LANES));
    let per_plane = comptime!(splits / planes);
    // Row `r` of split `s`'s head is row `first + s · step` of the partials (rows of `dim`).
    let first = (batch * splits * heads + head) * rows + row;
    let step = heads * rows;

    // Every load of the cube issued before any is used: the splits' log-sum-exps into shared
    // memory, this unit's partial outputs into registers (0 past the row's width).
    let units = comptime!(planes * LANES);
    let mut lses = Shared::<[f32]>::new_slice(splits);
    #[unroll]
    for round in 0..comptime!(splits.div_ceil(units)) {
        let split = unit + round * units;
        if split < splits {
            lses[split] = partial_lse[first + split * step];
        }
    }
    let mut parts = Array::<f32>::new(comptime!(per_plane * cols));
    #[unroll]
    for i in 0..per_plane {
        let at = (first + (plane + i * planes) * step) * dim;
        #[unroll]
        for j in 0..cols {
            let col = lane + j * LANES;
            parts[i * cols + j] = if comptime!(dim.is_multiple_of(LANES)) {
                f32::cast_from(partial_out[at + col])
            } else {
                select(
                    col < dim,
                    f32::cast_from(partial_out[at + select(col < dim, col, 0usize)]),
                    0.0,
                )
            };
        }
    }
    sync_cube();

    let mut top = neg_inf;
    #[unroll]
    for split in 0..splits {
        top = max(top, lses[split]);
    }
    // A row no split saw (`top = -inf`) weighs every split 0 instead of NaN.
    let seen = top > neg_inf;
    let shift = select(seen, top, 0.0);
    let mut weights = Array::<f32>::new(per_plane);
    #[unroll]
    for i in 0..per_plane {
        weights[i] = (lses[plane + i * planes] - shift).exp();
    }
    let mut sums = Shared::<[f32]>::new_slice(comptime!(planes * cols * LANES));
    #[unroll]
    for j in 0..cols {
        let mut acc = 0.0f32;
        #[unroll]
        for i in 0..per_plane {
            acc += weights[i] * parts[i * cols + j];
        }
        sums[(plane * cols + j) * LANES + lane] = acc;
    }
    sync_cube();

    if plane == 0 {
        let mut sum = 0.0f32;
        #[unroll]
        for split in 0..splits {
            sum += (lses[split] - shift).exp();
        }
        // `sum >= 1` where a split saw a key: the largest weight is exp(0).
        let inverse = select(seen, 1.0 / select(seen, sum, 1.0), 0.0);
        let out_at = ((batch * heads + head) * rows + row) * dim;
        #[unroll]
        for j in 0..cols {
            let col = lane + j * LANES;
            let mut acc = 0.0f32;
            #[unroll]
            for p in 0..planes {
                acc += sums[(p * cols + j) * LANES + lane];
            }
            if col < dim {
                out[out_at + col] = E::cast_from(acc * inverse);
            }
        }
        if lane == 0 {
            lse[(batch * heads + head) * rows + row] =
                select(seen, top + select(seen, sum, 1.0).ln(), neg_inf);
        }
    }
}

/// Merge the splits' `partial_out` (`[b, splits · h, sq, dv]`) and `partial_lse`
/// (`[b, splits · h, sq]`, f32) into `out` (`[b, h, sq, dv]`) and `lse` (`[b, h, sq]`), all
/// contiguous.
pub fn combine(
    partial_out: &KernelTensor,
    partial_lse: &KernelTensor,
    out: &KernelTensor,
    lse: &KernelTensor,
) {
    assert_eq!(partial_lse.dtype, F32);
    for tensor in [partial_out, partial_lse, out, lse] {
        assert!(tensor.is_contiguous(), "the merge indexes contiguous rows");
    }
    let dims = out.meta.shape().clone();
    if out.meta.num_elements() == 0 {
        return;
    }
    let client = &out.client;
    let address = crate::kernel::tensors::address_type(&[partial_out, partial_lse, out, lse]);
    let splits = partial_lse.meta.shape()[1] / dims[1];
    // A power of two that divides the splits (the plan's splits are powers of two).
    let planes = (1 << splits.trailing_zeros()).min(MOST_PLANES);
    // SAFETY: one cube per output row, within `out`'s (sq, h, b); partial loads are at heads
    // `split · h + head` below `splits · h` and columns below `dv` (clamped to column 0 past
    // it), shared memory is indexed below `splits` and `planes · cols · LANES`.
    unsafe {
        combine_splits::launch_unchecked(
            client,
            CubeCount::Static(dims[2] as u32, dims[1] as u32, dims[0] as u32),
            CubeDim::new_2d(LANES as u32, planes as u32),
            address,
            partial_out.clone().into_tensor_arg(),
            partial_lse.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            dims[1],
            dims[2],
            f32::NEG_INFINITY,
            splits,
            planes,
            dims[3],
            out.dtype,
        );
    }
}
