//! Launch of the backward: the plan for these inputs on this device ([`plan`](super::plan)),
//! then the gradients allocated and the kernels enqueued: the row dot `D = rowsum(dO ∘ O)`, the
//! dK/dV launch (its last wave in pieces where the plan splits it, [`tail`](super::tail)), and
//! dQ's own launch or the atomic dQ's conversion.

use cubecl::ir::ElemType;
use cubecl::prelude::*;
use cubecl::zspace::Shape;
use cubecl::zspace::metadata::Metadata;

use super::key_value::key_value_grads;
use super::plan::{BackwardPlan, BackwardProblem};
use super::query::{finish_query_grads, query_grads};
use super::row_dot::row_dot;
use super::tail::{TailPlan, TailSplitLaunch, finish_tail};
use super::walk::{StridesLaunch, WalkDimsLaunch};
use crate::kernel::config::{ScoreParams, TailPart, TileConfig, TilePath};
use crate::kernel::device::DeviceCaps;
use crate::kernel::grid::{cube_count, cube_dim};
use crate::kernel::tensors::{
    F32, KernelTensor, PackedRows, ScoreInputs, address_type, fill_tensor, output, stage_map,
    tma_aligned, vector_width,
};
use crate::kernel::tile::{MmaTile, PortableTile};

/// Whether the fused backward can run inputs of this dtype and head dims on this client, and
/// with which tile (the same one the forward picks).
pub fn backward_support(
    client: &Client,
    dtype: ElemType,
    head_dim: usize,
    value_dim: usize,
) -> Result<TilePath, String> {
    super::plan::support(&DeviceCaps::of(client, dtype), dtype, head_dim, value_dim)
}

/// The [`WalkDims`](super::walk::WalkDims) of a launch over queries `q` and keys `k` that
/// stages `first` and `second`, with statistics `stats` (`[b, h, seq_q]`).
pub(super) fn walk_dims(
    q: &Metadata,
    k: &Metadata,
    first: &Metadata,
    second: &Metadata,
    stats: &Metadata,
) -> WalkDimsLaunch {
    let strides = |t: &Metadata| {
        let s = t.strides();
        StridesLaunch::new(s[0], s[1], s[2])
    };
    WalkDimsLaunch::new(
        q.shape()[2],
        k.shape()[2],
        q.shape()[1],
        k.shape()[1],
        strides(first),
        strides(second),
        strides(stats),
    )
}

/// The dK/dV launches of the blocks `cfg` over `seq_k` keys of `kv_heads` heads and `batch`
/// sequences, with the last wave split as `tail` says: the whole grid, or its whole cubes and
/// then the pieces ([`TailPart`]).
pub(super) fn key_value_parts(
    cfg: &TileConfig,
    tail: Option<TailPlan>,
    seq_k: usize,
    kv_heads: usize,
    batch: usize,
) -> Vec<(CubeCount, TileConfig)> {
    let grid = || cube_count(cfg, seq_k, kv_heads, batch, 1);
    match tail {
        _ if seq_k == 0 => Vec::new(),
        None => vec![(grid(), *cfg)],
        Some(plan) => [
            (plan.whole > 0).then(|| (grid(), cfg.with_tail(TailPart::Whole))),
            Some((
                CubeCount::Static(plan.pieces as u32, plan.split as u32, 1),
                cfg.with_tail(TailPart::Pieces),
            )),
        ]
        .into_iter()
        .flatten()
        .collect(),
    }
}

/// The shape of the partial dK/dV sums of a split last wave: each piece's `cfg.block_q` rows
/// whole, dK's columns then dV's.
pub(super) fn partials_shape(cfg: &TileConfig, plan: TailPlan) -> Shape {
    Shape::new([
        plan.split * plan.pieces,
        cfg.block_q,
        cfg.head_dim + cfg.value_dim,
    ])
}

/// The [`TailSplit`](super::tail::TailSplit) of a dK/dV launch over `key_blocks` owned blocks
/// per (batch, head) whose grid's second extent is `grid_rows`, split as `tail` says.
pub(super) fn tail_split(
    tail: Option<TailPlan>,
    key_blocks: usize,
    grid_rows: usize,
) -> TailSplitLaunch {
    let (whole, pieces) = tail.map_or((0, 1), |plan| (plan.whole, plan.pieces));
    TailSplitLaunch::new(
        whole as u32,
        pieces as u32,
        key_blocks as u32,
        grid_rows as u32,
    )
}

/// The gradients of one backward: `bias` is the gradient of the scores, `[b, h, sq, sk]` in the
/// inputs' dtype, when it was asked for (the caller sums it over the bias's broadcast dims).
pub struct Grads {
    /// The queries' gradient, `[b, h, sq, d]`.
    pub q: KernelTensor,
    /// The keys' gradient, `[b, hkv, sk, d]`, summed over the query heads of each group.
    pub k: KernelTensor,
    /// The values' gradient, `[b, hkv, sk, dv]`, summed over the query heads of each group.
    pub v: KernelTensor,
    /// The scores' gradient, where it was asked for.
    pub bias: Option<KernelTensor>,
}

/// Gradients of the fused attention, from its inputs, its output `out`, its log-sum-exp `lse`
/// (`[b, h, sq]`, f32) and the output gradient `d_out`. Inputs as for
/// [`forward`](crate::kernel::forward::forward), accepted by [`backward_support`]. Unless
/// `deterministic`, dQ is summed by f32 atomics where that is faster and the device can run it
/// and no bias gradient is asked for (`bias_grad`; it is written by the dQ launch): the
/// [`DqMode`](super::plan::DqMode) of the plan.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: KernelTensor,
    k: KernelTensor,
    v: KernelTensor,
    inputs: ScoreInputs,
    out: KernelTensor,
    lse: KernelTensor,
    d_out: KernelTensor,
    params: ScoreParams,
    deterministic: bool,
    bias_grad: bool,
) -> Grads {
    let options = Options {
        deterministic,
        bias_grad,
        packed: None,
    };
    launch(q, k, v, inputs, out, lse, d_out, params, options)
}

/// Gradients of [`forward_packed`](crate::kernel::forward_packed): sequences of different
/// lengths packed along the rows of `[1, h, total, d]` tensors (any strides), as `packed` lays
/// them out, from the forward's output `out` (`[1, h, total_q, dv]`) and log-sum-exp `lse`
/// (`[1, h, total_q]`) and the output gradient `d_out`. Each sequence's gradients are its own;
/// dQ takes its own launch (deterministic). Returns contiguous `[1, h|hkv, total, d]`
/// gradients.
#[allow(clippy::too_many_arguments)]
pub fn backward_packed(
    q: KernelTensor,
    k: KernelTensor,
    v: KernelTensor,
    out: KernelTensor,
    lse: KernelTensor,
    d_out: KernelTensor,
    packed: PackedRows,
    params: ScoreParams,
) -> Grads {
    let options = Options {
        deterministic: true,
        bias_grad: false,
        packed: Some(packed.checked()),
    };
    launch(
        q,
        k,
        v,
        ScoreInputs::new(None, None),
        out,
        lse,
        d_out,
        params,
        options,
    )
}

/// How a backward runs beside its tensors.
struct Options {
    deterministic: bool,
    bias_grad: bool,
    /// Sequences packed along the rows, and where.
    packed: Option<PackedRows>,
}

/// Plan, allocate and enqueue one backward.
#[allow(clippy::too_many_arguments)]
fn launch(
    q: KernelTensor,
    k: KernelTensor,
    v: KernelTensor,
    inputs: ScoreInputs,
    out: KernelTensor,
    lse: KernelTensor,
    d_out: KernelTensor,
    params: ScoreParams,
    options: Options,
) -> Grads {
    let Options {
        deterministic,
        bias_grad,
        packed,
    } = options;
    let [q, k, v, out, lse, d_out] = [q, k, v, out, lse, d_out].map(KernelTensor::into_contiguous);
    let params = params.with_inputs(inputs.mask_dims(), inputs.bias.is_some());
    let bias_grad = bias_grad && inputs.bias.is_some();
    let dims = q.meta.shape().clone();
    let (batch, heads, seq_q, head_dim) = (dims[0], dims[1], dims[2], dims[3]);
    let (kv_heads, seq_k, value_dim) = (k.meta.shape()[1], k.meta.shape()[2], v.meta.shape()[3]);
    // The launches' grid: one batch entry per packed sequence, the longest one's row blocks.
    let (grid_batch, grid_q, grid_k) = match &packed {
        Some(p) => (p.starts.meta.shape()[1] - 1, p.max_query, p.max_key),
        None => (batch, seq_q, seq_k),
    };
    let client = q.client.clone();
    let dtype = q.dtype;

    let d_q = output(&q, Shape::new([batch, heads, seq_q, head_dim]), dtype);
    let d_k = output(&q, Shape::new([batch, kv_heads, seq_k, head_dim]), dtype);
    let d_v = output(&q, Shape::new([batch, kv_heads, seq_k, value_dim]), dtype);
    let delta = output(&q, Shape::new([batch, heads, seq_q]), F32);
    let d_bias = bias_grad.then(|| {
        let d_bias = output(&q, Shape::new([batch, heads, seq_q, seq_k]), dtype);
        // The dQ launch writes the pairs of the blocks it visits; a band skips some.
        if params.mask.left || params.mask.right {
            fill_tensor(&d_bias, 0.0);
        }
        d_bias
    });
    let grads = Grads {
        q: d_q.clone(),
        k: d_k.clone(),
        v: d_v.clone(),
        bias: d_bias.clone(),
    };
    if batch * heads == 0 {
        return grads;
    }
    let problem = BackwardProblem {
        dtype,
        batch: grid_batch,
        heads,
        kv_heads,
        seq_q: grid_q,
        seq_k: grid_k,
        head_dim,
        value_dim,
        params,
        bias_batch: inputs.bias.as_ref().map(|bias| bias.meta.shape()[0]),
        deterministic,
        bias_grad,
        staged_tma_aligned: tma_aligned(&q) && tma_aligned(&d_out),
        kv_tma_aligned: tma_aligned(&k) && tma_aligned(&v),
        varlen: packed.is_some(),
    };
    let plan = BackwardPlan::new(&DeviceCaps::of(&client, dtype), &problem)
        .unwrap_or_else(|reason| panic!("fused backward launched on unsupported input: {reason}"));
    log::debug!("fused backward: {plan}");
    let BackwardPlan {
        key_value: cfg,
        query: query_cfg,
        dq_width,
        tail,
        warpgroup,
        ..
    } = plan;
    let tile = cfg.tile;
    crate::testing::record_dq_launch(cfg.atomic_dq);
    if tail.is_some() {
        crate::testing::record_tail_split();
    }
    let key_blocks = grid_k.div_ceil(cfg.block_q);
    // The split cubes' partial dK/dV sums (see `tail`).
    let partials = tail.map(|plan| output(&q, partials_shape(&cfg, plan), F32));
    let key_value_parts = key_value_parts(&cfg, tail, grid_k, kv_heads, grid_batch);
    let grid_rows = if cfg.batch_inner {
        grid_batch
    } else {
        kv_heads
    };
    let starts = || {
        packed
            .as_ref()
            .map(|p| p.starts.clone().into_tensor_arg())
            .into()
    };
    let pieces = tail.map_or(1, |plan| plan.pieces);
    // The atomic dQ's f32 accumulator, contiguous and zeroed (see `key_value`).
    let accum = cfg.atomic_dq.then(|| {
        let accum = KernelTensor::empty(&client, Shape::new([batch, heads, seq_q, head_dim]), F32);
        fill_tensor(&accum, 0.0);
        accum
    });
    // The score inputs and the bias gradient (`[b, h, sq, sk]`) can be the largest tensors.
    let address = address_type(&[&q, &k, &v, &out, &d_out, &d_q, &d_k, &d_v])
        .max(inputs.address_type())
        .max(address_type(&d_bias.iter().collect::<Vec<_>>()));
    // The Hopper backward indexes in 32 bits; elsewhere the dK/dV launch runs.
    let warpgroup = warpgroup.filter(|_| address == cubecl::ir::AddressType::U32);
    let key_value_parts = if warpgroup.is_some() {
        Vec::new()
    } else {
        key_value_parts
    };
    if cfg.tma || warpgroup.is_some() {
        crate::testing::record_tma_launch();
    }
    let elem = dtype;
    let dtypes = [elem, inputs.mask_dtype()];
    let softcap = params.softcap.unwrap_or(1.0);
    let (seed_lo, seed_hi, threshold) = params.dropout_args();
    let alibi_pow2 = params.alibi_pow2.unwrap_or(1);
    let query_dims = walk_dims(&q.meta, &k.meta, &k.meta, &v.meta, &lse.meta);

    // SAFETY: shapes and strides were validated by the caller; every index the kernels form is
    // bounded by the tensors' shapes (rows past the ends are clamped, zero-filled or skipped).
    unsafe {
        let rows = batch * heads * seq_q;
        if rows > 0 {
            let width = vector_width(&[&out, &d_out]);
            let vectors = value_dim / width;
            // Planes of 32 lanes on the tensor-core tile's devices; the portable path keeps a
            // unit per row (no plane operations).
            let group = match tile {
                TilePath::TensorCore => vectors.next_power_of_two().min(32),
                TilePath::Portable => 1,
            };
            let units = rows * group;
            // Whole planes per cube, so that no group straddles two cubes.
            let cube_dim = CubeDim::new_1d(256);
            row_dot::launch_unchecked(
                &client,
                cubecl::calculate_cube_count_elemwise(&client, units, cube_dim),
                cube_dim,
                address,
                width,
                out.into_tensor_arg(),
                d_out.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                vectors,
                group,
                elem,
            );
        }
        #[cfg(feature = "cuda")]
        if let Some(warpgroup) = warpgroup {
            crate::testing::record_warpgroup_backward();
            super::warpgroup::launch(
                &q,
                &k,
                &v,
                &d_out,
                &lse,
                &delta,
                &d_k,
                &d_v,
                accum.as_ref(),
                &params,
                warpgroup,
            );
        }
        macro_rules! launch_grads {
            ($tile:ty) => {{
                for (grid, part_cfg) in key_value_parts.iter().cloned() {
                    let part_partials = partials
                        .clone()
                        .filter(|_| part_cfg.tail == TailPart::Pieces);
                    key_value_grads::launch_unchecked::<$tile>(
                        &client,
                        grid,
                        cube_dim(&cfg),
                        address,
                        dq_width,
                        q.clone().into_tensor_arg(),
                        k.clone().into_tensor_arg(),
                        v.clone().into_tensor_arg(),
                        inputs.mask_arg().into(),
                        inputs.bias_arg().into(),
                        d_out.clone().into_tensor_arg(),
                        stage_map(&q, &cfg).into(),
                        stage_map(&d_out, &cfg).into(),
                        lse.clone().into_tensor_arg(),
                        delta.clone().into_tensor_arg(),
                        d_k.clone().into_tensor_arg(),
                        d_v.clone().into_tensor_arg(),
                        match &accum {
                            Some(accum) => {
                                ComptimeOptionArgs::Some(accum.clone().into_tensor_arg())
                            }
                            None => ComptimeOptionArgs::None,
                        },
                        match part_partials {
                            Some(partials) => ComptimeOptionArgs::Some(partials.into_tensor_arg()),
                            None => ComptimeOptionArgs::None,
                        },
                        starts(),
                        walk_dims(&q.meta, &k.meta, &q.meta, &d_out.meta, &lse.meta),
                        tail_split(tail, key_blocks, grid_rows),
                        params.scale,
                        params.left,
                        params.right,
                        softcap,
                        seed_lo,
                        seed_hi,
                        threshold,
                        alibi_pow2,
                        part_cfg,
                        dtypes,
                    );
                }
                if let Some(partials) = partials {
                    let units = partials.meta.num_elements() / pieces;
                    let cube_dim = CubeDim::new(&client, units);
                    finish_tail::launch_unchecked(
                        &client,
                        cubecl::calculate_cube_count_elemwise(&client, units, cube_dim),
                        cube_dim,
                        address,
                        partials.into_tensor_arg(),
                        d_k.clone().into_tensor_arg(),
                        d_v.clone().into_tensor_arg(),
                        tail_split(tail, key_blocks, grid_rows),
                        seq_k,
                        params.scale,
                        cfg,
                        elem,
                    );
                }
                if let Some(accum) = &accum {
                    let width = vector_width(&[accum, &d_q]);
                    let units = batch * heads * seq_q * head_dim / width;
                    let cube_dim = CubeDim::new(&client, units);
                    finish_query_grads::launch_unchecked(
                        &client,
                        cubecl::calculate_cube_count_elemwise(&client, units, cube_dim),
                        cube_dim,
                        address,
                        width,
                        accum.clone().into_tensor_arg(),
                        d_q.clone().into_tensor_arg(),
                        params.scale,
                        elem,
                    );
                } else if seq_q > 0 {
                    query_grads::launch_unchecked::<$tile>(
                        &client,
                        cube_count(&query_cfg, grid_q, heads, grid_batch, 1),
                        cube_dim(&query_cfg),
                        address,
                        q.into_tensor_arg(),
                        k.into_tensor_arg(),
                        v.into_tensor_arg(),
                        inputs.mask_arg().into(),
                        inputs.bias_arg().into(),
                        d_out.into_tensor_arg(),
                        lse.into_tensor_arg(),
                        delta.into_tensor_arg(),
                        d_q.clone().into_tensor_arg(),
                        d_bias.clone().map(KernelTensor::into_tensor_arg).into(),
                        starts(),
                        query_dims,
                        params.scale,
                        params.left,
                        params.right,
                        softcap,
                        seed_lo,
                        seed_hi,
                        threshold,
                        alibi_pow2,
                        query_cfg,
                        dtypes,
                    );
                }
            }};
        }
        match tile {
            TilePath::TensorCore => {
                launch_grads!(MmaTile);
            }
            TilePath::Portable => {
                launch_grads!(PortableTile);
            }
        }
    }
    grads
}
