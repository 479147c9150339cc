//! The backend extension trait: what a backend implements to run the fused attention.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::{DType, Device};

use crate::kernel::TilePath;
use crate::options::FlashAttentionOptions;

/// The sizes and dtype of one attention call, as a backend sees them when it decides whether
/// its fused kernel can run it ([`FlashAttentionBackend::flash_attention_support`]).
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
/// boolean `mask` (`true` hides the (query, key) pair, as in Burn's `attention`) and an additive
/// `bias` (added to the scaled, softcapped scores), each `[batch|1, heads|1, seq_q|1, seq_k]`, a
/// dim of 1 broadcasting over it; the bias in the inputs' dtype. `Default` is neither.
///
/// [`flash_attention_masked`](crate::flash_attention_masked) validates them and builds this.
///
/// # Example
///
/// ```
/// use burn::tensor::ops::FloatTensor;
/// use burn_flash::{FlashAttentionBackend, FlashAttentionOptions, ScoreInputs};
///
/// fn biased<B: FlashAttentionBackend>(
///     [q, k, v]: [FloatTensor<B>; 3],
///     bias: FloatTensor<B>,
/// ) -> FloatTensor<B> {
///     let inputs = ScoreInputs { mask: None, bias: Some(bias) };
///     B::flash_attention_forward(q, k, v, inputs, FlashAttentionOptions::default()).output
/// }
/// ```
#[derive(Clone, Debug)]
pub struct ScoreInputs<B: Backend> {
    /// `[batch|1, heads|1, seq_q|1, seq_k]`, `true` hides the pair.
    pub mask: Option<BoolTensor<B>>,
    /// `[batch|1, heads|1, seq_q|1, seq_k]`, added to `scale · q·k` (after the softcap).
    pub bias: Option<FloatTensor<B>>,
}

impl<B: Backend> Default for ScoreInputs<B> {
    fn default() -> Self {
        Self {
            mask: None,
            bias: None,
        }
    }
}

/// What the fused forward returns.
///
/// # Example
///
/// ```
/// use burn::tensor::backend::Backend;
/// use burn::tensor::{Tensor, TensorPrimitive};
/// use burn_flash::{FlashAttentionBackend, FlashAttentionForward, FlashAttentionOptions};
///
/// fn forward<B: FlashAttentionBackend>(
///     q: Tensor<B, 4>,
///     k: Tensor<B, 4>,
///     v: Tensor<B, 4>,
/// ) -> (Tensor<B, 4>, Tensor<B, 3>) {
///     let FlashAttentionForward { output, lse } = B::flash_attention_forward(
///         q.into_primitive().tensor(),
///         k.into_primitive().tensor(),
///         v.into_primitive().tensor(),
///         Default::default(),
///         FlashAttentionOptions::default(),
///     );
///     (
///         Tensor::from_primitive(TensorPrimitive::Float(output)),
///         Tensor::from_primitive(TensorPrimitive::Float(lse)),
///     )
/// }
/// ```
#[derive(Clone, Debug)]
pub struct FlashAttentionForward<B: Backend> {
    /// The attention output, `[batch, heads, seq_q, value_dim]`, in the inputs' dtype.
    pub output: FloatTensor<B>,
    /// The log-sum-exp of each query row, `[batch, heads, seq_q]`, always f32: the natural log
    /// of `Σ_j exp(scale · q_i·k_j)` over the keys the row sees; `-inf` for a row that sees no
    /// key. The backward pass recomputes the softmax from it.
    pub lse: FloatTensor<B>,
}

/// The gradients the fused backward returns, each shaped and typed as its input.
///
/// # Example
///
/// ```
/// use burn::tensor::ops::{BoolTensor, FloatTensor};
/// use burn_flash::{FlashAttentionBackend, FlashAttentionGrads, FlashAttentionOptions};
///
/// fn value_grad<B: FlashAttentionBackend>(
///     [q, k, v]: [FloatTensor<B>; 3],
///     grad_output: FloatTensor<B>,
/// ) -> FloatTensor<B> {
///     let options = FlashAttentionOptions::default();
///     let forward =
///         B::flash_attention_forward(q.clone(), k.clone(), v.clone(), Default::default(), options);
///     let grads: FlashAttentionGrads<B> = B::flash_attention_backward(
///         q, k, v, Default::default(), forward.output, forward.lse, grad_output, options, false,
///     );
///     grads.v
/// }
/// ```
#[derive(Clone, Debug)]
pub struct FlashAttentionGrads<B: Backend> {
    /// Gradient of the queries, `[batch, heads, seq_q, head_dim]`.
    pub q: FloatTensor<B>,
    /// Gradient of the keys, `[batch, heads, seq_k, head_dim]`.
    pub k: FloatTensor<B>,
    /// Gradient of the values, `[batch, heads, seq_k, value_dim]`.
    pub v: FloatTensor<B>,
    /// Gradient of the bias, shaped as the bias, when one was given and its gradient asked
    /// for.
    pub bias: Option<FloatTensor<B>>,
}

/// A backend that runs the fused FlashAttention kernels.
///
/// Implemented for `burn_cubecl::CubeBackend<R, F, I, BT>` (any CubeCL runtime) and for
/// `burn_fusion::Fusion<B>` over such a backend, so `burn::backend::Wgpu` and (feature `cuda`)
/// `burn::backend::Cuda` work as Burn defines them. Most users call
/// [`flash_attention`](crate::flash_attention), which validates the inputs, asks
/// [`flash_attention_support`](Self::flash_attention_support) and takes Burn's unfused attention
/// when the fused kernel cannot run.
///
/// `burn::backend::Autodiff<B>` implements it on top of any `B` that does: its forward records
/// one node whose backward is [`flash_attention_backward`](Self::flash_attention_backward),
/// saving `q`, `k`, `v`, the output and the log-sum-exp only.
///
/// # Example
///
/// ```
/// use burn::tensor::{backend::Backend, Tensor};
/// use burn_flash::{flash_attention, FlashAttentionBackend, FlashAttentionOptions};
///
/// // Generic model code asks for the trait on top of `Backend`.
/// fn self_attention<B: FlashAttentionBackend>(x: Tensor<B, 4>) -> Tensor<B, 4> {
///     flash_attention(x.clone(), x.clone(), x, FlashAttentionOptions::causal())
/// }
/// ```
pub trait FlashAttentionBackend: Backend {
    /// Whether the fused forward can run this problem on this device, and with which matrix
    /// tile; `Err` carries the reason it cannot (a dtype, a head dim, a missing device
    /// feature). Decided up front, from the device's properties, without launching anything.
    ///
    /// # Example
    ///
    /// ```
    /// use burn::tensor::{DType, Device};
    /// use burn_flash::{FlashAttentionBackend, FlashAttentionProblem};
    ///
    /// fn fused<B: FlashAttentionBackend>(device: &Device<B>) -> bool {
    ///     let dims = [1, 8, 1024, 128];
    ///     let problem = FlashAttentionProblem::new(dims, dims, dims, DType::BF16, true);
    ///     B::flash_attention_support(device, &problem).is_ok()
    /// }
    /// ```
    fn flash_attention_support(
        device: &Device<Self>,
        problem: &FlashAttentionProblem,
    ) -> Result<TilePath, String>;

    /// Run the fused forward.
    ///
    /// Low level: the inputs must be valid (same device and dtype, matching shapes, a finite
    /// positive scale; see [`try_flash_attention_masked`](crate::try_flash_attention_masked)) and
    /// [`flash_attention_support`](Self::flash_attention_support) must have accepted them; this
    /// panics otherwise. The output is `[batch, heads, seq_q, value_dim]` in the inputs' dtype,
    /// the log-sum-exp `[batch, heads, seq_q]` in f32.
    ///
    /// # Example
    ///
    /// See [`FlashAttentionForward`].
    ///
    /// ```
    /// use burn::tensor::ops::{BoolTensor, FloatTensor};
    /// use burn_flash::{FlashAttentionBackend, FlashAttentionOptions};
    ///
    /// fn output<B: FlashAttentionBackend>(
    ///     q: FloatTensor<B>,
    ///     k: FloatTensor<B>,
    ///     v: FloatTensor<B>,
    /// ) -> FloatTensor<B> {
    ///     B::flash_attention_forward(q, k, v, Default::default(), FlashAttentionOptions::causal())
    ///         .output
    /// }
    /// ```
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        inputs: ScoreInputs<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionForward<Self>;

    /// Whether [`flash_attention_backward`](Self::flash_attention_backward) can run this
    /// problem on this device; `Err` carries the reason.
    ///
    /// # Example
    ///
    /// ```
    /// use burn::tensor::{DType, Device};
    /// use burn_flash::{FlashAttentionBackend, FlashAttentionProblem};
    ///
    /// fn trains_fused<B: FlashAttentionBackend>(device: &Device<B>) -> bool {
    ///     let dims = [1, 8, 512, 64];
    ///     let problem = FlashAttentionProblem::new(dims, dims, dims, DType::F32, true);
    ///     B::flash_attention_backward_support(device, &problem).is_ok()
    /// }
    /// ```
    fn flash_attention_backward_support(
        device: &Device<Self>,
        problem: &FlashAttentionProblem,
    ) -> Result<(), String>;

    /// Gradients of the fused attention with respect to `q`, `k` and `v` (and the bias when
    /// `bias_grad`), given the forward's `inputs`, `output` and `lse` and the gradient of the
    /// output. Recomputes the softmax block by block; nothing of size `seq_q × seq_k` is stored,
    /// except the bias gradient, which is as large as the bias broadcast to
    /// `[batch, heads, seq_q, seq_k]` before it is summed to the bias's shape. Deterministic
    /// unless `options.deterministic` is off.
    ///
    /// Low level, like [`flash_attention_forward`](Self::flash_attention_forward): the inputs
    /// must be valid and accepted by
    /// [`flash_attention_backward_support`](Self::flash_attention_backward_support).
    ///
    /// # Example
    ///
    /// See [`FlashAttentionGrads`].
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        inputs: ScoreInputs<Self>,
        output: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_output: FloatTensor<Self>,
        options: FlashAttentionOptions,
        bias_grad: bool,
    ) -> FlashAttentionGrads<Self>;
}
