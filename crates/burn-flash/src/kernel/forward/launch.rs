//! Launch of the forward: the plan for these inputs on this device ([`plan`](super::plan)),
//! then the outputs allocated, the mask packed where the plan says, and the kernel enqueued.

use std::sync::OnceLock;

use cubecl::ir::ElemType;
use cubecl::prelude::*;
use cubecl::zspace::Shape;

use super::combine::combine;
use super::kernel::flash_forward;
use super::layout::layout;
use super::plan::{ForwardPlan, ForwardProblem};
use crate::kernel::config::{MaskConfig, ScoreParams, TilePath};
use crate::kernel::device::DeviceCaps;
use crate::kernel::grid::{cube_count, cube_dim};
use crate::kernel::pack::pack_mask;
use crate::kernel::tensors::{
    CachedKeys, F32, I32, KernelTensor, PackedRows, ScoreInputs, U32, address_type, output,
    stage_map, tma_aligned,
};
use crate::kernel::tile::{MmaTile, PortableTile};
use crate::kernel::tuning::flag_override;
use crate::options::FlashAttentionOptions;

/// Decide whether the fused forward can run inputs of this dtype and head dims on this client,
/// and with which tile. `Err` carries the reason the caller logs before taking the fallback.
pub fn support(
    client: &Client,
    dtype: ElemType,
    head_dim: usize,
    value_dim: usize,
) -> Result<TilePath, String> {
    super::plan::support(&DeviceCaps::of(client, dtype), dtype, head_dim, value_dim)
}

/// Whether a forward of `q: [b, h, sq, d]` over `k: [b, hkv, sk, d]` and values of head dim
/// `value_dim`, laid out contiguously, with these options and no mask or bias input, takes the
/// Hopper forward on this client ([`ForwardPlan::warpgroup`]), as [`launch`] decides: where
/// the plan takes it and the output is addressed in 32 bits.
pub fn takes_warpgroup(
    client: &Client,
    dtype: ElemType,
    q: [usize; 4],
    k: [usize; 4],
    value_dim: usize,
    options: &FlashAttentionOptions,
) -> bool {
    let problem = ForwardProblem::contiguous(dtype, q, k, value_dim, options);
    let elements = q[0] * q[1] * q[2] * q[3].max(value_dim);
    ForwardPlan::new(&DeviceCaps::of(client, dtype), &problem)
        .is_ok_and(|plan| plan.warpgroup.is_some() && elements <= u32::MAX as usize)
}

/// Run the fused forward. `q: [b, h, sq, d]`, `k: [b, hkv, sk, d]`, `v: [b, hkv, sk, dv]` (`h`
/// a multiple of `hkv`), on one device with one dtype, accepted by [`support`]; the optional
/// boolean `mask` (`true` hides) and additive `bias` (the inputs' dtype) are
/// `[b|1, h|1, sq|1, sk]`. With `cached` keys, sequence `b` has only its first `lengths[b]`
/// keys (a length past `sk` counts as `sk`): its causal diagonal, window and ALiBi distances
/// are placed by that length, and the keys past it are never read; with a block table, K and V
/// are `[pages, hkv, page_size, d]` and `sk` is the table's pages per sequence times
/// `page_size`, a multiple of the plan's key blocks. Returns the output `[b, h, sq, dv]` in the
/// input dtype and the log-sum-exp `[b, h, sq]` in f32 (natural log of Σ exp(scale·s + bias)
/// over the visible keys, `s` softcapped; `-inf` for rows that see no key, whose output is 0).
pub fn forward(
    q: KernelTensor,
    k: KernelTensor,
    v: KernelTensor,
    inputs: ScoreInputs,
    cached: Option<CachedKeys>,
    params: ScoreParams,
) -> (KernelTensor, KernelTensor) {
    let paged = cached.as_ref().is_some_and(|c| c.block_table.is_some());
    // Keys and values are read in place where each head's rows are contiguous: a cache's
    // filled prefix is not copied on every call. Pages are read in place as they lie, whatever
    // their rows' stride (tensor maps and 16-byte copies take any).
    let (k, v) = if paged {
        (k.into_aligned_rows(), v.into_aligned_rows())
    } else {
        (k.into_head_rows(), v.into_head_rows())
    };
    let q = q.into_contiguous();
    let params = params.with_inputs(inputs.mask_dims(), inputs.bias.is_some());
    let dims = q.meta.shape().clone();
    let (batch, heads, seq_q, head_dim) = (dims[0], dims[1], dims[2], dims[3]);
    let value_dim = v.meta.shape()[3];
    let kv_heads = k.meta.shape()[1];
    let cached = cached.map(|cached| cached.checked(batch));
    if let Some(group) = packed_group(heads, kv_heads, seq_q, &inputs, &params) {
        // The query heads of a key/value head as the rows of one block: `[b, h, 1, d]` read as
        // `[b, hkv, h / hkv, d]` (the same elements), so each cached key is read once per
        // key/value head rather than once per query head. One query sees every key
        // (bottom-right), so the causal bound, which would place each row's diagonal apart,
        // is dropped.
        let params = ScoreParams {
            mask: MaskConfig {
                right: false,
                ..params.mask
            },
            right: 0,
            pack_groups: false,
            ..params
        };
        let rows = q.reshaped([batch, kv_heads, group, head_dim]);
        let (out, lse) = forward(rows, k, v, inputs, cached, params);
        return (
            out.reshaped([batch, heads, 1, value_dim]),
            lse.reshaped([batch, heads, 1]),
        );
    }
    launch(q, k, v, inputs, Sequences::Cached(cached), params)
}

/// Run the fused forward over sequences of different lengths packed along the rows:
/// `q: [1, h, total_q, d]`, `k: [1, hkv, total_k, d]`, `v: [1, hkv, total_k, dv]` (any
/// strides; rows read in place where they are 16-byte aligned), sequence `b` in the rows its
/// `packed.starts` give, each its own attention problem (its causal diagonal, window and ALiBi
/// distances placed on its own lengths). No mask or bias input. Returns the output
/// `[1, h, total_q, dv]` (its elements in `[total_q, h, dv]` order, the layout the rows came
/// in) and the log-sum-exp `[1, h, total_q]`; rows of a sequence without keys are 0 and `-inf`.
pub fn forward_packed(
    q: KernelTensor,
    k: KernelTensor,
    v: KernelTensor,
    packed: PackedRows,
    params: ScoreParams,
) -> (KernelTensor, KernelTensor) {
    let packed = packed.checked();
    assert!(
        q.meta.shape()[0] == 1 && k.meta.shape()[0] == 1 && v.meta.shape()[0] == 1,
        "packed sequences are one batch"
    );
    let (q, k, v) = (
        q.into_aligned_rows(),
        k.into_aligned_rows(),
        v.into_aligned_rows(),
    );
    launch(
        q,
        k,
        v,
        ScoreInputs::new(None, None),
        Sequences::Packed(packed),
        params,
    )
}

/// Where each sequence's rows lie beside the tensors' own shapes.
enum Sequences {
    /// Each sequence in a batch entry of its own, its keys cut to a cache's lengths where given.
    Cached(Option<CachedKeys>),
    /// Sequences packed along the rows of one batch entry.
    Packed(PackedRows),
}

/// Plan, allocate and enqueue one forward of inputs made ready by [`forward`] or
/// [`forward_packed`]. Its host time counts in [`crate::testing::forward_launch_time`]: under
/// Burn's fusion the device's thread runs it, and it bounds calls whose kernels take less.
fn launch(
    q: KernelTensor,
    k: KernelTensor,
    v: KernelTensor,
    inputs: ScoreInputs,
    sequences: Sequences,
    params: ScoreParams,
) -> (KernelTensor, KernelTensor) {
    let _timer = crate::testing::ForwardLaunchTimer::start();
    let client = q.client.clone();
    let dims = q.meta.shape().clone();
    let (heads, head_dim, total_q) = (dims[1], dims[3], dims[2]);
    let value_dim = v.meta.shape()[3];
    let (cached, packed) = match sequences {
        Sequences::Cached(cached) => (cached, None),
        Sequences::Packed(packed) => (None, Some(packed)),
    };
    let paged = cached.as_ref().is_some_and(|c| c.block_table.is_some());
    let (batch, seq_q, seq_k) = match &packed {
        Some(packed) => (
            packed.starts.meta.shape()[1] - 1,
            packed.max_query,
            packed.max_key,
        ),
        None => (
            dims[0],
            total_q,
            k.meta.shape()[2] * cached.as_ref().map_or(1, CachedKeys::pages_per_sequence),
        ),
    };
    let problem = ForwardProblem {
        dtype: q.dtype,
        batch,
        heads,
        seq_q,
        seq_k,
        head_dim,
        value_dim,
        params,
        inputs: inputs.facts(),
        key_lengths: cached.is_some(),
        page_size: paged.then(|| k.meta.shape()[2]),
        varlen: packed.is_some(),
        kv_tma_aligned: tma_aligned(&k) && tma_aligned(&v),
    };
    let plan = ForwardPlan::new(&DeviceCaps::of(&client, q.dtype), &problem)
        .unwrap_or_else(|reason| panic!("fused attention launched on unsupported input: {reason}"));
    log::debug!("fused forward: {plan}");
    let ForwardPlan {
        cfg,
        pack_mask: packs,
        kv_splits: splits,
        ..
    } = plan;
    let (out, lse) = match &packed {
        // Packed rows come `[total, h, d]`: the output is written in that order.
        Some(_) => (
            output(&q, Shape::new([1, total_q, heads, value_dim]), q.dtype).swapped(1, 2),
            output(&q, Shape::new([1, heads, total_q]), F32),
        ),
        None => (
            output(&q, Shape::new([batch, heads, seq_q, value_dim]), q.dtype),
            output(&q, Shape::new([batch, heads, seq_q]), F32),
        ),
    };
    if out.meta.num_elements() == 0 || batch == 0 {
        return (out, lse);
    }
    // The warpgroup kernel reads the queries by a tensor map too and indexes in 32 bits.
    #[cfg(feature = "cuda")]
    if let Some(warpgroup) = plan.warpgroup
        && tma_aligned(&q)
        && address_type(&[&q, &out, &lse]) == AddressType::U32
    {
        use crate::kernel::config::WarpgroupConfig;
        let packed = inputs
            .mask
            .as_ref()
            .filter(|_| warpgroup.mask.0)
            .map(|mask| pack_mask(mask, warpgroup.mask_rows(), WarpgroupConfig::BLOCK_KV));
        let bias = inputs.bias.as_ref().filter(|_| warpgroup.bias.0);
        crate::testing::record_warpgroup_forward();
        super::warpgroup::launch(
            &q,
            &k,
            &v,
            &out,
            &lse,
            packed.as_ref(),
            bias,
            &params,
            warpgroup,
        );
        return (out, lse);
    }
    // Split keys: each split's output and log-sum-exp as heads `split · heads + head` of partial
    // outputs, merged after the launch.
    let (kernel_out, kernel_lse) = if cfg.kv_split.0 {
        let partial_out = output(
            &q,
            Shape::new([batch, splits * heads, seq_q, value_dim]),
            q.dtype,
        );
        let partial_lse = output(&q, Shape::new([batch, splits * heads, seq_q]), F32);
        (partial_out, partial_lse)
    } else {
        (out.clone(), lse.clone())
    };

    let (inputs, hidden_blocks) = match (packs, &inputs.mask) {
        (true, Some(mask)) => {
            let packed = pack_mask(mask, cfg.block_q, cfg.block_kv);
            let inputs = ScoreInputs {
                mask: Some(packed.words),
                ..inputs
            };
            (inputs, Some(packed.hidden_blocks))
        }
        _ => (inputs, None),
    };
    if cfg.tma {
        crate::testing::record_tma_launch();
    }
    if cfg.three_kv_stages.0 {
        crate::testing::record_three_stage_forward();
    }
    let (k_map, v_map) = (stage_map(&k, &cfg), stage_map(&v, &cfg));
    let pages_per_sequence = cached.as_ref().map_or(1, CachedKeys::pages_per_sequence);
    let layout = layout(
        &q,
        &k,
        &v,
        &kernel_out,
        &kernel_lse,
        pages_per_sequence,
        cfg.tma,
    );
    let cube_dim = cube_dim(&cfg);
    let cube_count = cube_count(&cfg, seq_q, heads, batch, splits);
    // Keys and values staged by tensor maps are never indexed by the kernel (the copy engine
    // addresses them), so a cache of more than `u32::MAX` elements keeps 32-bit arithmetic
    // (performance.md, "Decoding against a KV cache"). The kernel still takes their first three
    // dims (batch or page, head, row); their rows' width is cut to one there, so that the
    // element count CubeCL passes with a tensor (a 32-bit scalar in a 32-bit kernel) fits.
    let (k, v, indexed_kv) = if cfg.tma {
        (k.with_unit_rows(), v.with_unit_rows(), vec![])
    } else {
        (k.clone(), v.clone(), vec![&k, &v])
    };
    // The score inputs can be the largest tensors of the launch (`[b, h, sq, sk]`).
    let address = address_type(&[&q, &kernel_out, &kernel_lse])
        .max(address_type(&indexed_kv))
        .max(inputs.address_type())
        .max(address_type(&hidden_blocks.iter().collect::<Vec<_>>()));
    if address == AddressType::U64 {
        crate::testing::record_wide_forward();
    }
    // Key lengths and block tables are read as they come, u32 or i32.
    let index_dtype = cached.as_ref().map_or(U32, |c| c.lengths.dtype);
    let dtypes = [q.dtype, inputs.mask_dtype(), index_dtype];
    let (seed_lo, seed_hi, threshold) = params.dropout_args();

    // SAFETY: shapes and strides were validated by the caller; every index the kernel forms is
    // bounded by the tensors' shapes, and out-of-range rows are clamped or zero-filled.
    macro_rules! launch {
        ($tile:ty) => {
            unsafe {
                flash_forward::launch_unchecked::<$tile>(
                    &client,
                    cube_count,
                    cube_dim,
                    address,
                    q.into_tensor_arg(),
                    k.into_tensor_arg(),
                    v.into_tensor_arg(),
                    k_map.into(),
                    v_map.into(),
                    inputs.mask_arg().into(),
                    hidden_blocks.map(KernelTensor::into_tensor_arg).into(),
                    inputs.bias_arg().into(),
                    cached
                        .as_ref()
                        .map(|c| c.lengths.clone().into_tensor_arg())
                        .into(),
                    cached
                        .and_then(|c| c.block_table)
                        .map(KernelTensor::into_tensor_arg)
                        .into(),
                    layout,
                    packed.map(|p| p.starts.into_tensor_arg()).into(),
                    kernel_out.clone().into_tensor_arg(),
                    kernel_lse.clone().into_tensor_arg(),
                    params.scale,
                    params.left,
                    params.right,
                    params.softcap.unwrap_or(1.0),
                    f32::NEG_INFINITY,
                    seed_lo,
                    seed_hi,
                    threshold,
                    params.alibi_pow2.unwrap_or(1),
                    cfg,
                    dtypes,
                )
            }
        };
    }
    // The portable tile never stages by tensor maps: its maps are `None`.
    match cfg.tile {
        TilePath::TensorCore => launch!(MmaTile),
        TilePath::Portable => launch!(PortableTile),
    }
    if cfg.kv_split.0 {
        combine(&kernel_out, &kernel_lse, &out, &lse);
    }
    (out, lse)
}

/// The query heads per key/value head the forward packs into one block's rows, where
/// [`ScoreParams::pack_groups`] asks for it (or `BURN_FLASH_PACK_GROUPS=1`) and
/// [`group_packs`] allows it.
pub(crate) fn packed_group(
    heads: usize,
    kv_heads: usize,
    seq_q: usize,
    inputs: &ScoreInputs,
    params: &ScoreParams,
) -> Option<usize> {
    let pack = pack_override().unwrap_or(params.pack_groups);
    (pack && heads > kv_heads && group_packs(seq_q, inputs, params)).then_some(heads / kv_heads)
}

/// Whether one query per sequence (`seq_q`) with these inputs and parameters can take its
/// key/value head's query heads as rows: nothing but the causal bound depends on the row (no
/// window, bias, ALiBi or dropout; a mask only where it is one row of keys per sequence,
/// `[b|1, 1, 1, sk]`, as a cache's lengths make it: every row of the group reads it alike),
/// and with one query aligned bottom-right that bound hides nothing.
fn group_packs(seq_q: usize, inputs: &ScoreInputs, params: &ScoreParams) -> bool {
    let mask_per_key = inputs
        .mask_dims()
        .is_none_or(|dims| dims[1] == 1 && dims[2] == 1);
    seq_q == 1
        && !params.mask.top_left.0
        && mask_per_key
        && inputs.bias.is_none()
        && !params.mask.left
        && params.alibi_pow2.is_none()
        && params.dropout.is_none()
}

/// `BURN_FLASH_PACK_GROUPS=0|1` decides [`ScoreParams::pack_groups`] for every forward of a
/// tuning run.
fn pack_override() -> Option<bool> {
    static OVERRIDE: OnceLock<Option<bool>> = OnceLock::new();
    *OVERRIDE.get_or_init(|| flag_override("BURN_FLASH_PACK_GROUPS"))
}

impl CachedKeys {
    /// These keys with `batch` lengths and a block table of `batch` rows, contiguous, both u32
    /// or both i32.
    ///
    /// # Panics
    ///
    /// Where the lengths or the table have another shape or dtype.
    fn checked(self, batch: usize) -> Self {
        let dtype = self.lengths.dtype;
        let check = |t: &KernelTensor, what: &str, rank: usize| {
            assert!(
                [U32, I32].contains(&t.dtype)
                    && t.dtype == dtype
                    && t.meta.shape().len() == rank
                    && t.meta.shape()[0] == batch,
                "{what} are {batch} rows of u32 or i32 (one dtype for both), not {:?} {:?}",
                t.meta.shape(),
                t.dtype
            );
        };
        check(&self.lengths, "key lengths", 1);
        if let Some(table) = &self.block_table {
            check(table, "block tables", 2);
        }
        Self {
            lengths: self.lengths.into_contiguous(),
            block_table: self.block_table.map(KernelTensor::into_contiguous),
        }
    }

    /// Pages each sequence's table lists (1 without a table: the keys are the sequence's own).
    fn pages_per_sequence(&self) -> usize {
        self.block_table.as_ref().map_or(1, |t| t.meta.shape()[1])
    }
}
