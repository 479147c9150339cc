//! Why an attention call was refused.

use core::fmt;

use burn::tensor::DType;

/// Inputs that [`try_flash_attention`](crate::try_flash_attention) refuses, before anything is
/// launched. [`flash_attention`](crate::flash_attention) panics with this error's message.
///
/// Shapes are `[batch, heads, seq, head_dim]` for `q`, `k` and `v`.
///
/// An input the fused kernel cannot run (a head dim it has no tile for, a runtime without the
/// features it needs) is not an error: it takes Burn's unfused attention, see
/// [`FlashAttentionPlan`](crate::FlashAttentionPlan).
///
/// # Example
///
/// ```
/// use burn_flash::FlashAttentionError;
///
/// let error = FlashAttentionError::HeadDimMismatch { q: 64, k: 32 };
/// assert_eq!(
///     error.to_string(),
///     "flash attention: q and k must have the same head dim (dim 3), got q 64 and k 32"
/// );
/// ```
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum FlashAttentionError {
    /// `q`, `k` and `v` do not have the same batch size (dim 0).
    BatchMismatch {
        /// Batch size of `q`.
        q: usize,
        /// Batch size of `k`.
        k: usize,
        /// Batch size of `v`.
        v: usize,
    },
    /// The heads (dim 1) do not fit together: `k` and `v` must have the same number, and the
    /// query heads must be a multiple of it (grouped-query attention; equal counts are plain
    /// multi-head attention).
    HeadsMismatch {
        /// Heads of `q`.
        q: usize,
        /// Heads of `k`.
        k: usize,
        /// Heads of `v`.
        v: usize,
    },
    /// `q` and `k` do not have the same head dim (dim 3).
    HeadDimMismatch {
        /// Head dim of `q`.
        q: usize,
        /// Head dim of `k`.
        k: usize,
    },
    /// `k` and `v` do not have the same sequence length (dim 2).
    KeyValueLengthMismatch {
        /// Sequence length of `k`.
        k: usize,
        /// Sequence length of `v`.
        v: usize,
    },
    /// `q`, `k` and `v` are not on the same device (as `Debug` text).
    DeviceMismatch {
        /// Device of `q`.
        q: String,
        /// Device of `k`.
        k: String,
        /// Device of `v`.
        v: String,
    },
    /// `q`, `k` and `v` do not have the same dtype.
    DTypeMismatch {
        /// Dtype of `q`.
        q: DType,
        /// Dtype of `k`.
        k: DType,
        /// Dtype of `v`.
        v: DType,
    },
    /// The dtype is not f16, bf16 or f32 (quantized, f64, flex32...).
    UnsupportedDType(DType),
    /// The scale is not finite and positive.
    InvalidScale(f64),
    /// The softcap is not finite and positive.
    InvalidSoftcap(f64),
    /// The dropout probability is not in `[0, 1)`.
    InvalidDropout(f64),
    /// Dropout was asked for on inputs the fused kernels cannot run (the reason); Burn's unfused
    /// attention, the fallback, has no dropout.
    DropoutUnsupported(String),
    /// The mask is not `[batch|1, seq_k]` (key padding) or `[batch|1, heads|1, seq_q|1, seq_k]`.
    MaskShape {
        /// The shapes it may have.
        expected: String,
        /// Its shape.
        got: Vec<usize>,
    },
    /// The bias is not `[batch|1, heads|1, seq_q|1, seq_k]`.
    BiasShape {
        /// The shapes it may have.
        expected: String,
        /// Its shape.
        got: Vec<usize>,
    },
    /// The bias's dtype is not that of `q`, `k` and `v`.
    BiasDType {
        /// The dtype of `q`.
        expected: DType,
        /// The dtype of the bias.
        got: DType,
    },
    /// The mask, the bias or the key lengths are not on the device of `q`, `k` and `v` (as
    /// `Debug` text).
    InputDevice {
        /// `"mask"`, `"bias"`, `"key lengths"` or `"block table"`.
        input: &'static str,
        /// The device of `q`.
        expected: String,
        /// The device of the input.
        got: String,
    },
    /// New keys or values for a [`KvCache`](crate::KvCache) are not `[batch, kv_heads, n, dim]`
    /// of the cache.
    CacheShape {
        /// `"keys"` or `"values"`.
        input: &'static str,
        /// The shape they must have.
        expected: Vec<usize>,
        /// Their shape.
        got: Vec<usize>,
    },
    /// New keys or values for a [`KvCache`](crate::KvCache) have another dtype or device than
    /// the cache (as text: dtype on device).
    CacheInput {
        /// `"keys"` or `"values"`.
        input: &'static str,
        /// The cache's dtype and device.
        expected: String,
        /// Theirs.
        got: String,
    },
    /// A [`KvCache`](crate::KvCache)'s sequence would outgrow its capacity.
    CacheFull {
        /// Positions each sequence holds.
        capacity: usize,
        /// Positions the longest sequence would need.
        needed: usize,
    },
    /// An option a [`KvCache`](crate::KvCache) cannot apply to its sequences (what and why).
    CacheOptions(String),
    /// The key lengths of
    /// [`try_flash_attention_with_lengths`](crate::try_flash_attention_with_lengths) are not
    /// `[batch]`.
    KeyLengthsShape {
        /// The batch size of `q`, `k` and `v`.
        expected: usize,
        /// The lengths' size.
        got: usize,
    },
    /// An option per-sequence key lengths cannot apply on the path the call takes (what and
    /// where).
    KeyLengthsOptions(String),
    /// The key and value pages of
    /// [`try_flash_attention_paged`](crate::try_flash_attention_paged) differ in their count,
    /// size or heads (`[pages, page_size, kv_heads, dim]`).
    PagesShape {
        /// The keys' shape.
        k: Vec<usize>,
        /// The values' shape.
        v: Vec<usize>,
    },
    /// A page's size is not a positive multiple of 64 keys (a page holds whole key blocks).
    PageSize(usize),
    /// The block table is not `[batch, pages per sequence]`.
    BlockTableShape {
        /// The batch size of `q`.
        expected: usize,
        /// The table's shape.
        got: Vec<usize>,
    },
    /// A [`PagedKvCache`](crate::PagedKvCache) has too few free pages for an append.
    PagesExhausted {
        /// Pages free.
        free: usize,
        /// Pages the append needs.
        needed: usize,
    },
    /// The query and key lengths of [`PackedSequences::with_keys`](crate::PackedSequences)
    /// count different numbers of sequences.
    PackedLengths {
        /// Sequences the query lengths count.
        queries: usize,
        /// Sequences the key lengths count.
        keys: usize,
    },
    /// An input of [`try_flash_attention_varlen`](crate::try_flash_attention_varlen) does not
    /// have the rows (dim 0) its [`PackedSequences`](crate::PackedSequences) add up to.
    PackedRows {
        /// `q` or `k`.
        input: &'static str,
        /// The rows the sequences add up to.
        expected: usize,
        /// The input's rows.
        got: usize,
    },
}

impl fmt::Display for FlashAttentionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "flash attention: ")?;
        match self {
            Self::BatchMismatch { q, k, v } => write!(
                f,
                "q, k and v must have the same batch size (dim 0), got q {q}, k {k} and v {v}"
            ),
            Self::HeadsMismatch { q, k, v } => write!(
                f,
                "k and v must have the same number of heads (dim 1), and q a multiple of it, \
                 got q {q}, k {k} and v {v}"
            ),
            Self::HeadDimMismatch { q, k } => write!(
                f,
                "q and k must have the same head dim (dim 3), got q {q} and k {k}"
            ),
            Self::KeyValueLengthMismatch { k, v } => write!(
                f,
                "k and v must have the same sequence length (dim 2), got k {k} and v {v}"
            ),
            Self::DeviceMismatch { q, k, v } => write!(
                f,
                "q, k and v must be on the same device, got q on {q}, k on {k} and v on {v}"
            ),
            Self::DTypeMismatch { q, k, v } => write!(
                f,
                "q, k and v must have the same dtype, got q {q:?}, k {k:?} and v {v:?}"
            ),
            Self::UnsupportedDType(dtype) => {
                write!(f, "the dtype must be f16, bf16 or f32, got {dtype:?}")
            }
            Self::InvalidScale(scale) => {
                write!(f, "the scale must be finite and positive, got {scale}")
            }
            Self::InvalidSoftcap(cap) => {
                write!(f, "the softcap must be finite and positive, got {cap}")
            }
            Self::InvalidDropout(prob) => {
                write!(f, "the dropout probability must be in [0, 1), got {prob}")
            }
            Self::DropoutUnsupported(reason) => write!(
                f,
                "dropout needs the fused kernels, which cannot run these inputs: {reason}"
            ),
            Self::MaskShape { expected, got } => {
                write!(f, "the mask must be {expected}, got {got:?}")
            }
            Self::BiasShape { expected, got } => {
                write!(f, "the bias must be {expected}, got {got:?}")
            }
            Self::BiasDType { expected, got } => write!(
                f,
                "the bias must have the dtype of q, k and v ({expected:?}), got {got:?}"
            ),
            Self::InputDevice {
                input,
                expected,
                got,
            } => write!(
                f,
                "the {input} must be on the device of q, k and v ({expected}), got {got}"
            ),
            Self::CacheShape {
                input,
                expected,
                got,
            } => write!(
                f,
                "the new {input} of a cache must be {expected:?} ([batch, kv_heads, n, dim]), \
                 got {got:?}"
            ),
            Self::CacheInput {
                input,
                expected,
                got,
            } => write!(
                f,
                "the new {input} of a cache must be {expected}, as the cache, got {got}"
            ),
            Self::CacheFull { capacity, needed } => write!(
                f,
                "the cache holds {capacity} positions per sequence, {needed} are needed"
            ),
            Self::CacheOptions(what) => {
                write!(f, "a key/value cache cannot apply {what}")
            }
            Self::KeyLengthsShape { expected, got } => write!(
                f,
                "the key lengths must be [{expected}] (one per sequence), got [{got}]"
            ),
            Self::KeyLengthsOptions(what) => {
                write!(f, "per-sequence key lengths cannot apply {what}")
            }
            Self::PagesShape { k, v } => write!(
                f,
                "key and value pages must have the same count, size and heads \
                 ([pages, page_size, kv_heads, dim]), got k {k:?} and v {v:?}"
            ),
            Self::PageSize(size) => write!(
                f,
                "a page must hold a positive multiple of 64 keys, got {size}"
            ),
            Self::BlockTableShape { expected, got } => write!(
                f,
                "the block table must be [{expected}, pages per sequence], got {got:?}"
            ),
            Self::PagesExhausted { free, needed } => write!(
                f,
                "the paged cache has {free} free pages, the append needs {needed}"
            ),
            Self::PackedLengths { queries, keys } => write!(
                f,
                "packed sequences need one key length per query length, got {queries} and {keys}"
            ),
            Self::PackedRows {
                input,
                expected,
                got,
            } => write!(
                f,
                "the packed sequences add up to {expected} rows of {input} (dim 0), got {got}"
            ),
        }
    }
}

impl std::error::Error for FlashAttentionError {}
