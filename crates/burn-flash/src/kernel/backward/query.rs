//! dQ: one cube per block of queries of one head. The cube owns its queries and output gradients
//! as tile operands and walks the key blocks of its key/value head that they can see, staging K
//! and V. It also writes the bias gradient when one is asked for.

use cubecl::prelude::*;

use super::walk::{Span, Sweep, WalkDims, walk};
use crate::kernel::band::kv_blocks;
use crate::kernel::config::TileConfig;
use crate::kernel::dropout::Dropout;
use crate::kernel::grid::{batch_and_head, row_block};
use crate::kernel::softmax::Softcap;
use crate::kernel::tile::AttentionTile;

// `exp` as the forward computes it (`__expf`), which the backward's `P` must reproduce.
#[cube(
    launch_unchecked,
    create_dummy_kernel,
    address_type = "dynamic",
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
#[allow(clippy::too_many_arguments)]
pub fn query_grads<E: Float, M: Int, T: AttentionTile<E>>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    mask: ComptimeOption<&Tensor<M>>,
    bias: ComptimeOption<&Tensor<E>>,
    d_out: &Tensor<E>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    d_q: &mut Tensor<E>,
    mut d_bias: ComptimeOption<&mut Tensor<E>>,
    starts: ComptimeOption<&Tensor<u32>>,
    dims: WalkDims,
    scale: f32,
    band_left: u32,
    band_right: u32,
    softcap: f32,
    dropout_seed_lo: u32,
    dropout_seed_hi: u32,
    dropout_threshold: u32,
    alibi_pow2: u32,
    #[comptime] cfg: TileConfig,
    #[define(E, M)] _dtypes: [ElemType; 2],
) {
    // With packed sequences the grid's batch is the sequence, the tensors' batch is 0, and
    // every row is counted from the sequence's first (`q_row`, `k_row` in the tensors).
    let (sequence, head) = batch_and_head(cfg);
    let batch = if comptime!(cfg.varlen.0) {
        usize::new(0)
    } else {
        sequence
    };
    let (band, q_row, k_row) = dims.band(band_left, band_right).of_packed(starts, sequence);
    let kv_head = head / (dims.heads / dims.kv_heads);
    let span = Span {
        owned_start: row_block(cfg) * cfg.block_q,
        band,
        softcap: Softcap::new(scale, softcap),
        inv_scale: 1.0 / scale,
        dropout: Dropout::new(
            dropout_seed_lo,
            dropout_seed_hi,
            dropout_threshold,
            dims.heads,
            dims.seq_k,
        ),
        alibi_pow2,
    };
    let query_cfg = comptime!(cfg.with_widths(cfg.head_dim, cfg.head_dim));
    let grad_cfg = comptime!(cfg.with_widths(cfg.value_dim, cfg.value_dim));

    let q_head = batch * q.stride(0) + head * q.stride(1) + q_row * q.stride(2);
    let g_head = batch * d_out.stride(0) + head * d_out.stride(1) + q_row * d_out.stride(2);
    let (mut queries, grads) = T::load_query_pair(
        q,
        q_head,
        d_out,
        g_head,
        span.owned_start,
        span.band.seq_q,
        cfg,
        grad_cfg,
    );
    let mut grad_q = Array::<f32>::new(query_cfg.out_regs());
    #[unroll]
    for reg in 0..query_cfg.out_regs() {
        grad_q[reg] = 0.0;
    }
    // Owning queries, there is no second gradient and dQ is written directly.
    let mut unused = Array::<f32>::new(1usize);
    let mut no_accum = ComptimeOption::<&mut Tensor<Atomic<Vector<f32, Const<1>>>>>::new_None();

    let (first_block, end_block) = kv_blocks(span.band, span.owned_start, cfg);
    // A packed sequence shorter than the longest has row blocks past its end: they walk nothing.
    let end_block = if comptime!(cfg.varlen.0) {
        select(span.owned_start < span.band.seq_q, end_block, first_block)
    } else {
        end_block
    };
    let sweep = Sweep {
        first_base: dims.first_strides.at(batch, kv_head) + k_row * dims.first_strides.row,
        first_step: 0,
        first_row_stride: dims.first_strides.row,
        second_base: dims.second_strides.at(batch, kv_head) + k_row * dims.second_strides.row,
        second_step: 0,
        second_row_stride: dims.second_strides.row,
        stat_base: dims.stat_strides.at(batch, head) + q_row * dims.stat_strides.row,
        stat_step: 0,
        accum_base: 0,
        accum_step: 0,
        members: 1,
        first_block,
        end_block,
        batch: sequence,
        first_head: head,
    };
    // K and V of this launch are staged by plain asynchronous copies (`cfg.tma` is the dK/dV
    // launch's).
    let no_map = ComptimeOption::<TensorMap<E, Tiled>>::new_None();
    let steps = sweep.members * sweep.blocks();
    walk::<E, M, T, Const<1>>(
        &queries,
        &grads,
        k,
        v,
        &no_map,
        &no_map,
        mask,
        bias,
        &mut d_bias,
        sweep,
        0usize,
        steps,
        lse,
        delta,
        span,
        scale,
        &mut grad_q,
        &mut unused,
        &mut no_accum,
        false,
        cfg,
    );

    // The owned queries are done with: their shared memory stages dQ.
    let dq_head = batch * d_q.stride(0) + head * d_q.stride(1) + q_row * d_q.stride(2);
    let dq_row = d_q.stride(2);
    T::store_owned(
        &mut queries,
        &grad_q,
        scale,
        d_q,
        dq_head,
        dq_row,
        span.owned_start,
        span.band.seq_q,
        query_cfg,
    );
}

/// dQ from the atomic accumulator of the dK/dV launch: `d_q = scale · accum` in the input type,
/// one unit per vector of the two contiguous tensors.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn finish_query_grads<E: Float, N: Size>(
    accum: &Tensor<Vector<f32, N>>,
    d_q: &mut Tensor<Vector<E, N>>,
    scale: f32,
    #[define(E)] _dtype: ElemType,
) {
    if ABSOLUTE_POS < d_q.len() {
        d_q[ABSOLUTE_POS] = Vector::cast_from(accum[ABSOLUTE_POS] * Vector::new(scale));
    }
}
