//! dK and dV: one cube per block of keys of one key/value head. The cube owns its keys and values
//! as tile operands and, for each query head of the group reading that key/value head, walks the
//! query blocks that can see them, staging Q and dO. Summing the group in registers gives GQA's
//! reduced dK/dV with no atomics and no per-query-head copy. Given a dQ accumulator
//! (`[b, h, seq_q, head_dim]` f32, contiguous, zeroed, read as vectors of `N`), it also adds
//! each staged query block's `dS·K` to it with atomics, so no separate dQ launch is needed.
//! With `cfg.tma`, `q_map` and `d_out_map` are tensor maps of `q` and `d_out` that stage them.
//! Where the last wave is split ([`tail`](super::tail)), `cfg.tail` says which part this launch
//! takes; the pieces write their partial sums to `partials`.

use cubecl::prelude::*;

use super::tail::{TailSplit, store_partials};
use super::walk::{Span, Sweep, WalkDims, walk};
use crate::kernel::band::query_range;
use crate::kernel::config::{TailPart, TileConfig};
use crate::kernel::dropout::Dropout;
use crate::kernel::grid::batch_and_head;
use crate::kernel::softmax::Softcap;
use crate::kernel::tile::AttentionTile;

// `exp` as the forward computes it (`__expf`), which the backward's `P` must reproduce.
#[cube(
    launch_unchecked,
    create_dummy_kernel,
    address_type = "dynamic",
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
// `collapsible_if`: the split's runtime test sits inside its comptime one, out of other launches.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn key_value_grads<E: Float, M: Int, T: AttentionTile<E>, N: Size>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    mask: ComptimeOption<&Tensor<M>>,
    bias: ComptimeOption<&Tensor<E>>,
    d_out: &Tensor<E>,
    q_map: &ComptimeOption<TensorMap<E, Tiled>>,
    d_out_map: &ComptimeOption<TensorMap<E, Tiled>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    d_k: &mut Tensor<E>,
    d_v: &mut Tensor<E>,
    mut d_q_accum: ComptimeOption<&mut Tensor<Atomic<Vector<f32, N>>>>,
    partials: ComptimeOption<&mut Tensor<f32>>,
    starts: ComptimeOption<&Tensor<u32>>,
    dims: WalkDims,
    tail: TailSplit,
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
    if comptime!(cfg.tail == TailPart::Whole) {
        if tail.is_split() {
            terminate!();
        }
    }
    let (owned_block, sequence, kv_head) = if comptime!(cfg.tail == TailPart::Pieces) {
        tail.piece_owner(cfg)
    } else {
        let (batch, kv_head) = batch_and_head(cfg);
        (CUBE_POS_X as usize, batch, kv_head)
    };
    // With packed sequences the grid's batch is the sequence, the tensors' batch is 0, and
    // every row is counted from the sequence's first (`q_row`, `k_row` in the tensors).
    let batch = if comptime!(cfg.varlen.0) {
        usize::new(0)
    } else {
        sequence
    };
    let (band, q_row, k_row) = dims.band(band_left, band_right).of_packed(starts, sequence);
    let group = dims.heads / dims.kv_heads;
    let owned_start = owned_block * cfg.block_q;
    let key_cfg = comptime!(cfg.with_widths(cfg.head_dim, cfg.head_dim));
    let value_cfg = comptime!(cfg.with_widths(cfg.value_dim, cfg.value_dim));

    let k_head = batch * k.stride(0) + kv_head * k.stride(1) + k_row * k.stride(2);
    let v_head = batch * v.stride(0) + kv_head * v.stride(1) + k_row * v.stride(2);
    let (mut keys, mut values) = T::load_query_pair(
        k,
        k_head,
        v,
        v_head,
        owned_start,
        band.seq_k,
        cfg,
        value_cfg,
    );
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

    // Only the query blocks holding a query that sees one of the owned keys, for each query
    // head of the group.
    let owned_end = min(owned_start + cfg.block_q, band.seq_k);
    let (first_query, end_query) = query_range(band, owned_start, owned_end, cfg.mask);
    // A packed sequence shorter than the longest has key blocks past its end: they walk nothing.
    let (first_query, end_query) = if comptime!(cfg.varlen.0) {
        let empty = owned_start >= band.seq_k;
        (
            select(empty, 0usize, first_query),
            select(empty, 0usize, end_query),
        )
    } else {
        (first_query, end_query)
    };
    let first_head = kv_head * group;
    let sweep = Sweep {
        first_base: dims.first_strides.at(batch, first_head) + q_row * dims.first_strides.row,
        first_step: dims.first_strides.head,
        first_row_stride: dims.first_strides.row,
        second_base: dims.second_strides.at(batch, first_head) + q_row * dims.second_strides.row,
        second_step: dims.second_strides.head,
        second_row_stride: dims.second_strides.row,
        stat_base: dims.stat_strides.at(batch, first_head) + q_row * dims.stat_strides.row,
        stat_step: dims.stat_strides.head,
        accum_base: (batch * dims.heads + first_head) * band.seq_q * cfg.head_dim,
        accum_step: band.seq_q * cfg.head_dim,
        members: group,
        first_block: first_query / cfg.block_kv,
        end_block: end_query.div_ceil(cfg.block_kv),
        batch: sequence,
        first_head,
    };
    let span = Span {
        owned_start,
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
    let total = sweep.members * sweep.blocks();
    let (first_step, steps) = if comptime!(cfg.tail == TailPart::Pieces) {
        tail.piece_steps(total)
    } else {
        (0usize, total)
    };
    // Owning keys, the bias gradient is left to the dQ launch.
    let mut no_bias_grad = ComptimeOption::<&mut Tensor<E>>::new_None();
    walk::<E, M, T, N>(
        &keys,
        &values,
        q,
        d_out,
        q_map,
        d_out_map,
        mask,
        bias,
        &mut no_bias_grad,
        sweep,
        first_step,
        steps,
        lse,
        delta,
        span,
        scale,
        &mut grad_k,
        &mut grad_v,
        &mut d_q_accum,
        true,
        cfg,
    );

    #[comptime]
    if let ComptimeOption::Some(partials) = partials {
        store_partials::<E, T>(&grad_k, &grad_v, partials, tail.piece_id(), cfg);
    } else {
        store_whole::<E, T>(
            &mut keys,
            &grad_k,
            &mut values,
            &grad_v,
            d_k,
            d_v,
            batch,
            kv_head,
            k_row,
            owned_start,
            band.seq_k,
            scale,
            cfg,
        );
    }
}

/// Write a whole walk's `scale · dK` and dV to rows `k_row + owned_start..` of the (`batch`,
/// `kv_head`) head. The owned keys and values are done with: their shared memory stages dK and dV.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_whole<E: Float, T: AttentionTile<E>>(
    keys: &mut T::Query,
    grad_k: &Array<f32>,
    values: &mut T::Query,
    grad_v: &Array<f32>,
    d_k: &mut Tensor<E>,
    d_v: &mut Tensor<E>,
    batch: usize,
    kv_head: usize,
    k_row: usize,
    owned_start: usize,
    seq_k: usize,
    scale: f32,
    #[comptime] cfg: TileConfig,
) {
    let key_cfg = comptime!(cfg.with_widths(cfg.head_dim, cfg.head_dim));
    let dk_head = batch * d_k.stride(0) + kv_head * d_k.stride(1) + k_row * d_k.stride(2);
    let dk_row = d_k.stride(2);
    T::store_owned(
        keys,
        grad_k,
        scale,
        d_k,
        dk_head,
        dk_row,
        owned_start,
        seq_k,
        key_cfg,
    );
    let dv_head = batch * d_v.stride(0) + kv_head * d_v.stride(1) + k_row * d_v.stride(2);
    let dv_row = d_v.stride(2);
    T::store_owned(
        values,
        grad_v,
        1.0,
        d_v,
        dv_head,
        dv_row,
        owned_start,
        seq_k,
        cfg,
    );
}
