//! Attention over a cache's keys: cut to per-sequence lengths (a cache filled to different
//! lengths), and paged (each sequence's keys in pages a block table lists). The fused forward
//! reads the lengths and the table on the device; where it cannot serve the call (a gradient is
//! needed, or the fused kernel does not run the inputs), the pages are gathered and the lengths
//! become a boolean mask, on the device too.

use burn::backend::Dispatch;
use burn::tensor::ops::CausalAlignment;
use burn::tensor::{Bool, DType, Int, IntDType, Tensor};

use crate::api::{
    AttentionMask, FlashAttentionPlan, Plan, padded_to, plan, plan_problem,
    try_flash_attention_masked, validate_heads, validate_types,
};
use crate::backend::{FlashAttentionBackend, FlashAttentionProblem, KeyCache};
use crate::error::FlashAttentionError;
use crate::options::FlashAttentionOptions;

/// Attention of `q: [batch, heads, seq_q, head_dim]` over keys `k: [batch, kv_heads, seq_k,
/// head_dim]` and values `v: [batch, kv_heads, seq_k, value_dim]` of which sequence `b` has
/// only its first `key_lengths[b]` positions (`key_lengths: [batch]`, on `q`'s device; lengths
/// are clamped into `0..=seq_k`): a key/value cache filled to different lengths, as
/// FlashAttention-2's `cache_seqlens`. The queries are each sequence's last `seq_q` positions:
/// with `options.causal` query `i` of sequence `b` sees its keys up to `i + key_lengths[b] -
/// seq_q` (bottom-right, per sequence; top-left: up to `i`), and a window and ALiBi's distances
/// are placed on the same diagonal. Rows that see no key are 0. Returns `[batch, heads, seq_q,
/// value_dim]`.
///
/// Where no input requires a gradient and the fused kernel runs the inputs, one fused forward
/// reads each length on the device and stops at it: nothing past a sequence's length is read,
/// and decoding keeps its fast paths (grouped heads packed into a block's rows, keys split
/// across cubes). Otherwise the lengths, the causal bound and the window become one boolean
/// mask `[batch, 1, seq_q, seq_k]`, made on the device, through
/// [`try_flash_attention_masked`] (differentiable, or Burn's unfused attention); ALiBi is
/// refused there ([`FlashAttentionError::KeyLengthsOptions`]).
///
/// Refused as [`try_flash_attention`](crate::try_flash_attention) refuses its inputs, and
/// where `key_lengths` is not `[batch]` ([`FlashAttentionError::KeyLengthsShape`]) or not on
/// `q`'s device ([`FlashAttentionError::InputDevice`]).
///
/// # Example
///
/// ```no_run
/// use burn::tensor::{Device, Distribution, Int, Tensor, TensorData};
/// use burn_flash::{try_flash_attention_with_lengths, FlashAttentionOptions};
///
/// let device = Device::wgpu(Default::default());
/// let random = |dims| Tensor::<4>::random(dims, Distribution::Normal(0.0, 1.0), &device);
/// // Three sequences cached to 900, 17 and 0 positions, one new query each.
/// let (keys, values) = (random([3, 2, 1024, 64]), random([3, 2, 1024, 64]));
/// let lengths = Tensor::<1, Int>::from_data(TensorData::new(vec![900i32, 17, 0], [3]), &device);
/// let out = try_flash_attention_with_lengths(
///     random([3, 8, 1, 64]),
///     keys,
///     values,
///     lengths,
///     FlashAttentionOptions::causal(),
/// )
/// .unwrap();
/// assert_eq!(out.dims(), [3, 8, 1, 64]);
/// ```
pub fn try_flash_attention_with_lengths(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    key_lengths: Tensor<1, Int>,
    options: FlashAttentionOptions,
) -> Result<Tensor<4>, FlashAttentionError> {
    let Plan {
        problem: p,
        scale,
        route,
    } = plan(&q, &k, &v, options)?;
    validate_lengths(&key_lengths, &p, &q)?;
    let options = options.with_scale(scale);
    if route == FlashAttentionPlan::Zeros {
        let shape = [p.batch, p.heads, p.seq_q, p.value_dim];
        return Ok(Tensor::zeros(shape, (&q.device(), p.dtype)));
    }
    let tracked = [&q, &k, &v].iter().any(|t| t.is_tracked());
    let fused = matches!(
        route,
        FlashAttentionPlan::Fused(_) | FlashAttentionPlan::FusedPadded { .. }
    );
    if !fused || tracked || q.dims()[3] == 0 {
        if options.alibi {
            return Err(FlashAttentionError::KeyLengthsOptions(
                "ALiBi where a gradient is needed or the fused kernel cannot run the inputs".into(),
            ));
        }
        let mask = hidden_keys(key_lengths, p.seq_q, p.seq_k, &options);
        let mut options = options.with_causal(false);
        options.window = None;
        return try_flash_attention_masked(q, k, v, Some(AttentionMask::Full(mask)), None, options);
    }
    let key_lengths = kernel_lengths(key_lengths, p.seq_k);
    let value_dim = p.value_dim;
    let (q, k, v) = padded_to(&route, q, k, v);
    let output = <Dispatch as FlashAttentionBackend>::flash_attention_forward_cached(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        KeyCache::Lengths(key_lengths.into_dispatch()),
        options,
    );
    let output = Tensor::<4>::from_dispatch(output);
    Ok(if output.dims()[3] == value_dim {
        output
    } else {
        output.narrow(3, 0, value_dim)
    })
}

/// Attention of `q: [batch, heads, seq_q, head_dim]` over a paged cache: keys
/// `k_pages: [pages, page_size, kv_heads, head_dim]` and values `v_pages: [pages, page_size,
/// kv_heads, value_dim]` (the layout of vLLM and FlashAttention-2), sequence `b`'s keys
/// `p · page_size ..` in page `block_table[b, p]` (`block_table: [batch, pages per sequence]`),
/// its first `key_lengths[b]` keys filled (`[batch]`, clamped into what its table lists). As
/// [`try_flash_attention_with_lengths`] otherwise: the queries are each sequence's last
/// `seq_q` positions, the causal bound, a window and ALiBi on each sequence's own diagonal.
/// `page_size` is a multiple of 64, so that a page holds whole key blocks.
///
/// Where no input requires a gradient and the fused kernel runs the inputs at their head dims,
/// one fused forward finds each key block through the table and reads it in place: the cache
/// is never copied. Otherwise (a gradient, dropout, head dims the tile runs only padded, or no
/// fused kernel) the pages are gathered into `[batch, kv_heads, pages · page_size, dim]` keys
/// and values (a copy of the listed pages, page numbers clamped into the cache) and attended by
/// [`try_flash_attention_with_lengths`].
///
/// Refused: key and value pages that differ in count, size or heads
/// ([`FlashAttentionError::PagesShape`]), a page size that is not a positive multiple of 64
/// ([`FlashAttentionError::PageSize`]), a table that is not `[batch, _]`
/// ([`FlashAttentionError::BlockTableShape`]), lengths that are not `[batch]`, inputs on another
/// device, and what [`try_flash_attention`](crate::try_flash_attention) refuses.
///
/// # Example
///
/// ```no_run
/// use burn::tensor::{Device, Distribution, Int, Tensor, TensorData};
/// use burn_flash::{try_flash_attention_paged, FlashAttentionOptions};
///
/// let device = Device::wgpu(Default::default());
/// let random = |dims| Tensor::<4>::random(dims, Distribution::Normal(0.0, 1.0), &device);
/// // 8 pages of 64 keys; sequence 0 in pages 5 and 2 (100 keys), sequence 1 in page 7 (30).
/// let (k_pages, v_pages) = (random([8, 64, 2, 64]), random([8, 64, 2, 64]));
/// let int = |values: Vec<i32>, dims: [usize; 2]| {
///     Tensor::<2, Int>::from_data(TensorData::new(values, dims), &device)
/// };
/// let table = int(vec![5, 2, 7, 0], [2, 2]);
/// let lengths = int(vec![100, 30], [1, 2]).reshape([2]);
/// let out = try_flash_attention_paged(
///     random([2, 8, 1, 64]),
///     k_pages,
///     v_pages,
///     table,
///     lengths,
///     FlashAttentionOptions::causal(),
/// )
/// .unwrap();
/// assert_eq!(out.dims(), [2, 8, 1, 64]);
/// ```
pub fn try_flash_attention_paged(
    q: Tensor<4>,
    k_pages: Tensor<4>,
    v_pages: Tensor<4>,
    block_table: Tensor<2, Int>,
    key_lengths: Tensor<1, Int>,
    options: FlashAttentionOptions,
) -> Result<Tensor<4>, FlashAttentionError> {
    let dtype = validate_types(&q, &k_pages, &v_pages)?;
    let ([batch, heads, _, q_dim], k_dims, v_dims) = (q.dims(), k_pages.dims(), v_pages.dims());
    let [pages, page_size, kv_heads, head_dim] = k_dims;
    if k_dims[..3] != v_dims[..3] {
        return Err(FlashAttentionError::PagesShape {
            k: k_dims.to_vec(),
            v: v_dims.to_vec(),
        });
    }
    validate_heads(heads, kv_heads, v_dims[2], q_dim, head_dim)?;
    if page_size == 0 || !page_size.is_multiple_of(64) {
        return Err(FlashAttentionError::PageSize(page_size));
    }
    let [table_batch, per_sequence] = block_table.dims();
    if table_batch != batch {
        return Err(FlashAttentionError::BlockTableShape {
            expected: batch,
            got: block_table.dims().to_vec(),
        });
    }
    check_device("block table", &block_table.device(), &q)?;
    let seq_k = if pages == 0 {
        0
    } else {
        per_sequence * page_size
    };
    let value_dim = v_dims[3];
    let problem = FlashAttentionProblem::new(
        q.dims(),
        [batch, kv_heads, seq_k, head_dim],
        [batch, kv_heads, seq_k, value_dim],
        dtype,
        options.causal,
    );
    validate_lengths(&key_lengths, &problem, &q)?;
    let Plan {
        problem: p,
        scale,
        route,
    } = plan_problem(problem, options, &q.device())?;
    if route == FlashAttentionPlan::Zeros {
        let shape = [p.batch, p.heads, p.seq_q, p.value_dim];
        return Ok(Tensor::zeros(shape, (&q.device(), p.dtype)));
    }
    let tracked = [&q, &k_pages, &v_pages].iter().any(|t| t.is_tracked());
    let dropout = options.dropout.is_some_and(|d| d.is_active());
    if matches!(route, FlashAttentionPlan::Fused(_)) && !tracked && !dropout {
        let output = <Dispatch as FlashAttentionBackend>::flash_attention_forward_cached(
            q.into_dispatch(),
            k_pages.into_dispatch(),
            v_pages.into_dispatch(),
            KeyCache::Paged(
                kernel_lengths(key_lengths, p.seq_k).into_dispatch(),
                block_table.into_dispatch(),
            ),
            options.with_scale(scale),
        );
        return Ok(Tensor::from_dispatch(output));
    }
    // The listed pages, gathered into each sequence's rows.
    let rows = block_table
        .clamp(0, pages as i64 - 1)
        .reshape([batch * per_sequence]);
    let gather = |t: Tensor<4>| {
        let dim = t.dims()[3];
        t.select(0, rows.clone())
            .reshape([batch, seq_k, kv_heads, dim])
            .swap_dims(1, 2)
    };
    try_flash_attention_with_lengths(q, gather(k_pages), gather(v_pages), key_lengths, options)
}

/// `key_lengths` as the fused kernel reads them: u32 and i32 as they are (the kernel stops at
/// the keys' end and reads a negative length as 0), others clamped into `0..=seq_k` and cast
/// to i32.
fn kernel_lengths(key_lengths: Tensor<1, Int>, seq_k: usize) -> Tensor<1, Int> {
    match key_lengths.dtype() {
        DType::U32 | DType::I32 => key_lengths,
        _ => key_lengths.clamp(0, seq_k as i64).cast(IntDType::I32),
    }
}

/// An input on `q`'s device, or the error naming it.
fn check_device(
    input: &'static str,
    device: &burn::tensor::Device,
    q: &Tensor<4>,
) -> Result<(), FlashAttentionError> {
    let expected = q.device();
    if device != &expected {
        return Err(FlashAttentionError::InputDevice {
            input,
            expected: format!("{expected:?}"),
            got: format!("{device:?}"),
        });
    }
    Ok(())
}

/// Check the lengths' shape and device.
fn validate_lengths(
    key_lengths: &Tensor<1, Int>,
    p: &FlashAttentionProblem,
    q: &Tensor<4>,
) -> Result<(), FlashAttentionError> {
    let [batch] = key_lengths.dims();
    if batch != p.batch {
        return Err(FlashAttentionError::KeyLengthsShape {
            expected: p.batch,
            got: batch,
        });
    }
    check_device("key lengths", &key_lengths.device(), q)
}

/// `[batch, 1, seq_q, seq_k]`, `true` where a query does not see a key: the keys past its
/// sequence's length, and those the causal bound or the window hide from its diagonal (key
/// `i + length - seq_q` of query `i` bottom-right, key `i` top-left). Signed 32-bit positions,
/// as every runtime has them.
fn hidden_keys(
    key_lengths: Tensor<1, Int>,
    seq_q: usize,
    seq_k: usize,
    options: &FlashAttentionOptions,
) -> Tensor<4, Bool> {
    let device = key_lengths.device();
    let [batch] = key_lengths.dims();
    let shape = [batch, 1, seq_q, seq_k];
    let positions = |len: usize, at: [usize; 4]| {
        Tensor::<1, Int>::arange(0..len as i64, (&device, DType::I32))
            .reshape(at)
            .expand(shape)
    };
    let keys = positions(seq_k, [1, 1, 1, seq_k]);
    let lengths = key_lengths
        .clamp(0, seq_k as i64)
        .cast(IntDType::I32)
        .reshape([batch, 1, 1, 1])
        .expand(shape);
    let queries = positions(seq_q, [1, 1, seq_q, 1]);
    let diagonal = match options.causal_alignment {
        CausalAlignment::BottomRight => queries + lengths.clone() - seq_q as i64,
        CausalAlignment::TopLeft => queries,
    };
    let window = options.window.unwrap_or_default();
    let right = if options.causal {
        Some(0)
    } else {
        window.right
    };
    let mut hidden = keys.clone().greater_equal(lengths);
    if let Some(right) = right {
        hidden = hidden.bool_or(keys.clone().greater(diagonal.clone() + right as i64));
    }
    if let Some(left) = window.left {
        hidden = hidden.bool_or(keys.lower(diagonal - left as i64));
    }
    hidden
}
