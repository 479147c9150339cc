//! The backend extension trait: what a backend implements to run the fused attention.

use burn::backend::tensor::{BoolTensor, FloatTensor, IntTensor};
use burn::backend::{Backend, ExtensionType, backend_extension};
use burn::tensor::DType;

use crate::options::FlashAttentionOptions;

/// The sizes and dtype of one attention call, as the fused kernels see them when they decide
/// whether they can run it ([`flash_attention_support`](crate::flash_attention_support)).
///
/// `q: [batch, heads, seq_q, head_dim]`, `k: [batch, kv_heads, seq_k, head_dim]`,
/// `v: [batch, kv_heads, seq_k, value_dim]`, `heads` a multiple of `kv_heads` (grouped-query
/// attention when they differ).
///
/// # Example
///
/// ```
/// use burn::tensor::DType;
/// use burn_flash::FlashAttentionProblem;
///
/// let problem = FlashAttentionProblem::new(
///     [2, 8, 128, 64],
///     [2, 8, 256, 64],
///     [2, 8, 256, 64],
///     DType::BF16,
///     true,
/// );
/// assert_eq!((problem.seq_q, problem.seq_k, problem.head_dim), (128, 256, 64));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct FlashAttentionProblem {
    /// Batch size.
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (`heads` is a multiple of it).
    pub kv_heads: usize,
    /// Query sequence length.
    pub seq_q: usize,
    /// Key/value sequence length.
    pub seq_k: usize,
    /// Head dim of `q` and `k`.
    pub head_dim: usize,
    /// Head dim of `v` (and of the output).
    pub value_dim: usize,
    /// Dtype of `q`, `k`, `v` and the output.
    pub dtype: DType,
    /// Whether the causal mask applies.
    pub causal: bool,
}

impl FlashAttentionProblem {
    /// The problem of inputs with these shapes (`[batch, heads, seq, dim]`), dtype and mask.
    /// Nothing is checked here; `q` gives batch, heads, seq_q and head_dim, `k` kv_heads and
    /// seq_k, `v` value_dim.
    ///
    /// # Example
    ///
    /// ```
    /// use burn::tensor::DType;
    /// use burn_flash::FlashAttentionProblem;
    ///
    /// let dims = [1, 4, 32, 64];
    /// let problem = FlashAttentionProblem::new(dims, dims, dims, DType::F32, false);
    /// assert_eq!(problem.heads, 4);
    /// ```
    pub fn new(q: [usize; 4], k: [usize; 4], v: [usize; 4], dtype: DType, causal: bool) -> Self {
        Self {
            batch: q[0],
            heads: q[1],
            kv_heads: k[1],
            seq_q: q[2],
            seq_k: k[2],
            head_dim: q[3],
            value_dim: v[3],
            dtype,
            causal,
        }
    }
}

/// The per-score inputs of one attention call beside `q`, `k` and `v`, as backend tensors: a
/// boolean mask (`true` hides the (query, key) pair, as in Burn's `attention`) and an additive
/// bias (added to the scaled, softcapped scores), each `[batch|1, heads|1, seq_q|1, seq_k]`, a
/// dim of 1 broadcasting over it; the bias in the inputs' dtype.
///
/// [`flash_attention_masked`](crate::flash_attention_masked) validates them and builds this.
///
/// # Example
///
/// ```
/// use burn::backend::tensor::{BoolTensor, FloatTensor};
/// use burn_flash::{FlashAttentionBackend, ScoreInputs};
///
/// fn bias_of<B: FlashAttentionBackend>(inputs: ScoreInputs<B>) -> Option<FloatTensor<B>> {
///     inputs.into_parts().1
/// }
/// ```
#[derive(ExtensionType, Clone, Debug)]
pub enum ScoreInputs<B: Backend> {
    /// Plain attention.
    Neither,
    /// A boolean mask only.
    Mask(BoolTensor<B>),
    /// An additive bias only.
    Bias(FloatTensor<B>),
    /// A boolean mask and an additive bias.
    Both(BoolTensor<B>, FloatTensor<B>),
}

impl<B: Backend> ScoreInputs<B> {
    /// The inputs holding `mask` and `bias`, either of which may be absent.
    ///
    /// # Example
    ///
    /// ```
    /// use burn::backend::tensor::FloatTensor;
    /// use burn_flash::{FlashAttentionBackend, ScoreInputs};
    ///
    /// fn biased<B: FlashAttentionBackend>(bias: FloatTensor<B>) -> ScoreInputs<B> {
    ///     ScoreInputs::new(None, Some(bias))
    /// }
    /// ```
    pub fn new(mask: Option<BoolTensor<B>>, bias: Option<FloatTensor<B>>) -> Self {
        match (mask, bias) {
            (None, None) => Self::Neither,
            (Some(mask), None) => Self::Mask(mask),
            (None, Some(bias)) => Self::Bias(bias),
            (Some(mask), Some(bias)) => Self::Both(mask, bias),
        }
    }

    /// The mask and the bias, either of which may be absent.
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::{FlashAttentionBackend, ScoreInputs};
    ///
    /// fn plain<B: FlashAttentionBackend>() -> bool {
    ///     let (mask, bias) = ScoreInputs::<B>::Neither.into_parts();
    ///     mask.is_none() && bias.is_none()
    /// }
    /// ```
    pub fn into_parts(self) -> (Option<BoolTensor<B>>, Option<FloatTensor<B>>) {
        match self {
            Self::Neither => (None, None),
            Self::Mask(mask) => (Some(mask), None),
            Self::Bias(bias) => (None, Some(bias)),
            Self::Both(mask, bias) => (Some(mask), Some(bias)),
        }
    }

    /// The bias, if there is one.
    pub fn bias(&self) -> Option<&FloatTensor<B>> {
        match self {
            Self::Bias(bias) | Self::Both(_, bias) => Some(bias),
            Self::Neither | Self::Mask(_) => None,
        }
    }
}

/// Which keys of `k` and `v` each sequence holds in a cache, for
/// [`FlashAttentionBackend::flash_attention_forward_cached`]: integer tensors on the device.
///
/// # Example
///
/// ```
/// use burn::backend::tensor::IntTensor;
/// use burn_flash::{FlashAttentionBackend, KeyCache};
///
/// fn paged<B: FlashAttentionBackend>(lengths: IntTensor<B>, table: IntTensor<B>) -> KeyCache<B> {
///     KeyCache::Paged(lengths, table)
/// }
/// ```
#[derive(ExtensionType, Clone, Debug)]
pub enum KeyCache<B: Backend> {
    /// `k: [batch, kv_heads, seq_k, head_dim]` and `v` alike; sequence `b` holds its first
    /// `lengths[b]` rows (`lengths: [batch]`).
    Lengths(IntTensor<B>),
    /// `k: [pages, page_size, kv_heads, head_dim]` and `v` alike (the layout of vLLM and
    /// FlashAttention-2); sequence `b` holds its first `lengths[b]` keys (`lengths: [batch]`),
    /// its keys `p · page_size ..` in page `block_table[b, p]` (`block_table: [batch, pages
    /// per sequence]`). `page_size` is a multiple of 64.
    Paged(IntTensor<B>, IntTensor<B>),
}

/// Where the sequences of a batch packed along the rows lie (FlashAttention-2's `cu_seqlens`):
/// sequence `b`'s queries are rows `starts[0, b]..starts[0, b + 1]` of `q: [1, heads, total_q,
/// head_dim]`, its keys rows `starts[1, b]..starts[1, b + 1]` of `k` and `v` (`starts: [2,
/// sequences + 1]`, each row cumulative from 0); `max_query` and `max_key` are the longest
/// sequence's lengths. [`PackedSequences`](crate::PackedSequences) builds it.
///
/// # Example
///
/// ```
/// use burn::backend::tensor::IntTensor;
/// use burn_flash::{FlashAttentionBackend, PackedStarts};
///
/// fn two<B: FlashAttentionBackend>(starts: IntTensor<B>) -> PackedStarts<B> {
///     // Sequences of 3 and 5 rows: starts [[0, 3, 8], [0, 3, 8]].
///     PackedStarts { starts, max_query: 5, max_key: 5 }
/// }
/// ```
#[derive(ExtensionType, Clone, Debug)]
pub struct PackedStarts<B: Backend> {
    /// `[2, sequences + 1]`: the cumulative query (row 0) and key (row 1) lengths.
    pub starts: IntTensor<B>,
    /// The longest sequence's queries.
    pub max_query: usize,
    /// The longest sequence's keys.
    pub max_key: usize,
}

/// What the fused forward returns.
#[derive(ExtensionType, Clone, Debug)]
pub struct FlashAttentionForward<B: Backend> {
    /// The attention output, `[batch, heads, seq_q, value_dim]`, in the inputs' dtype.
    pub output: FloatTensor<B>,
    /// The log-sum-exp of each query row, `[batch, heads, seq_q]`, always f32: the natural log
    /// of `Σ_j exp(scale · q_i·k_j)` over the keys the row sees; `-inf` for a row that sees no
    /// key. The backward pass recomputes the softmax from it.
    pub lse: FloatTensor<B>,
}

/// The bias gradient of a backward: absent unless a bias was given and its gradient asked for.
#[derive(ExtensionType, Clone, Debug)]
pub enum BiasGrad<B: Backend> {
    /// No bias gradient was asked for.
    Absent,
    /// The bias's gradient, shaped as the bias.
    Present(FloatTensor<B>),
}

impl<B: Backend> BiasGrad<B> {
    /// The gradient, if there is one.
    pub fn into_option(self) -> Option<FloatTensor<B>> {
        match self {
            Self::Absent => None,
            Self::Present(grad) => Some(grad),
        }
    }
}

/// The gradients the fused backward returns, each shaped and typed as its input.
#[derive(ExtensionType, Clone, Debug)]
pub struct FlashAttentionGrads<B: Backend> {
    /// Gradient of the queries, `[batch, heads, seq_q, head_dim]`.
    pub q: FloatTensor<B>,
    /// Gradient of the keys, `[batch, kv_heads, seq_k, head_dim]`.
    pub k: FloatTensor<B>,
    /// Gradient of the values, `[batch, kv_heads, seq_k, value_dim]`.
    pub v: FloatTensor<B>,
    /// Gradient of the bias, when one was given and its gradient asked for.
    #[extension_type]
    pub bias: BiasGrad<B>,
}

/// A backend that runs the fused FlashAttention kernels.
///
/// Implemented for `burn_cubecl::CubeBackend` (every CubeCL runtime: wgpu, CUDA, …), for
/// `burn_fusion::Fusion` over it (the backend Burn's `Device::wgpu` and `Device::cuda` run on),
/// and for `burn_autodiff::Autodiff<B>` over any of these: its forward records one node whose
/// backward is [`flash_attention_backward`](Self::flash_attention_backward), saving `q`, `k`,
/// `v`, the output and the log-sum-exp only. Burn's `Dispatch` backend routes a tensor's call to
/// the implementation of its device.
///
/// Most users call [`flash_attention`](crate::flash_attention), which validates the inputs, asks
/// [`flash_attention_support`](crate::flash_attention_support) and takes Burn's unfused
/// attention when the fused kernel cannot run.
///
/// # Example
///
/// ```
/// use burn::backend::Dispatch;
/// use burn::tensor::Tensor;
/// use burn_flash::{FlashAttentionBackend, FlashAttentionOptions, ScoreInputs};
///
/// fn output(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
///     let forward = <Dispatch as FlashAttentionBackend>::flash_attention_forward(
///         q.into_dispatch(),
///         k.into_dispatch(),
///         v.into_dispatch(),
///         ScoreInputs::Neither,
///         FlashAttentionOptions::causal(),
///     );
///     Tensor::from_dispatch(forward.output)
/// }
/// ```
#[backend_extension(Cube, Autodiff)]
pub trait FlashAttentionBackend: Backend {
    /// Run the fused forward.
    ///
    /// Low level: the inputs must be valid (same device and dtype, matching shapes, a finite
    /// positive scale; see [`try_flash_attention_masked`](crate::try_flash_attention_masked)) and
    /// [`flash_attention_support`](crate::flash_attention_support) must have accepted them; this
    /// panics otherwise. The output is `[batch, heads, seq_q, value_dim]` in the inputs' dtype,
    /// the log-sum-exp `[batch, heads, seq_q]` in f32.
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        #[extension_type] inputs: ScoreInputs<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionForward<Self>;

    /// Run the fused forward over a cache: keys and values of which sequence `b` holds only its
    /// first `lengths[b]` positions (a length past the keys it can hold counts as all of them),
    /// in rows of its own or in pages ([`KeyCache`]). The causal diagonal, a window and ALiBi's
    /// distances are placed on each sequence's own length (bottom-right: its last query sits on
    /// its last key). Returns the output `[batch, heads, seq_q, value_dim]`; rows that see no
    /// key are 0.
    ///
    /// For inference: no gradient flows through it (on an autodiff backend the output is not
    /// tracked); [`try_flash_attention_with_lengths`](crate::try_flash_attention_with_lengths)
    /// takes a masked, differentiable path where an input requires a gradient. Low level, like
    /// [`flash_attention_forward`](Self::flash_attention_forward): the inputs must be valid and
    /// supported.
    fn flash_attention_forward_cached(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        #[extension_type] keys: KeyCache<Self>,
        options: FlashAttentionOptions,
    ) -> FloatTensor<Self>;

    /// Run the fused forward over sequences of different lengths packed along the rows (see
    /// [`PackedStarts`]): `q: [1, heads, total_q, head_dim]`, `k: [1, kv_heads, total_k,
    /// head_dim]` and `v` alike (any strides: the views of FlashAttention-2's `[total, heads,
    /// dim]`), each sequence attending to its own keys, its causal diagonal, window and ALiBi
    /// distances placed on its own lengths. Returns the output `[1, heads, total_q, value_dim]`
    /// (its elements in `[total_q, heads, value_dim]` order) and the log-sum-exp `[1, heads,
    /// total_q]`; rows that see no key are 0 and `-inf`. On an autodiff backend it records one
    /// node whose backward is
    /// [`flash_attention_backward_packed`](Self::flash_attention_backward_packed).
    ///
    /// Low level, like [`flash_attention_forward`](Self::flash_attention_forward): no mask or
    /// bias input, and the inputs must be valid and supported;
    /// [`try_flash_attention_varlen`](crate::try_flash_attention_varlen) checks them.
    fn flash_attention_forward_packed(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        #[extension_type] sequences: PackedStarts<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionForward<Self>;

    /// Gradients of [`flash_attention_forward_packed`](Self::flash_attention_forward_packed)
    /// with respect to `q`, `k` and `v`, each sequence's its own, from the forward's output and
    /// log-sum-exp and the output's gradient; contiguous `[1, heads|kv_heads, total, dim]`.
    /// Deterministic (dQ by its own launch). Low level, like
    /// [`flash_attention_backward`](Self::flash_attention_backward).
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward_packed(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        #[extension_type] sequences: PackedStarts<Self>,
        output: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_output: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionGrads<Self>;

    /// Gradients of the fused attention with respect to `q`, `k` and `v` (and the bias when
    /// `bias_grad`), given the forward's `inputs`, `output` and `lse` and the gradient of the
    /// output. Recomputes the softmax block by block; nothing of size `seq_q × seq_k` is stored,
    /// except the bias gradient, which is as large as the bias broadcast to
    /// `[batch, heads, seq_q, seq_k]` before it is summed to the bias's shape. Deterministic
    /// unless `options.deterministic` is off.
    ///
    /// Low level, like [`flash_attention_forward`](Self::flash_attention_forward): the inputs
    /// must be valid and accepted by
    /// [`flash_attention_backward_support`](crate::flash_attention_backward_support).
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        #[extension_type] inputs: ScoreInputs<Self>,
        output: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_output: FloatTensor<Self>,
        options: FlashAttentionOptions,
        bias_grad: bool,
    ) -> FlashAttentionGrads<Self>;
}
