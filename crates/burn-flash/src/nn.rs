//! Modules for models: multi-head attention whose core is the fused kernel.
//!
//! [`FlashMultiHeadAttention`] stands where `burn::nn::attention::MultiHeadAttention` would: the
//! same four projections (`query`, `key`, `value`, `output`; the key and value ones narrower
//! with grouped-query attention), the same configuration fields plus the attention features of
//! [`FlashAttentionOptions`] (causal, sliding window, softcap, grouped heads), and a choice of
//! [`AttentionKernel`] for the `softmax(Q·Kᵀ / sqrt(d_k)) · V` in the middle, so one model can
//! be run with the fused kernel, Burn's own attention or the unfused computation on the same
//! weights. Padding and arbitrary masks and additive biases go through
//! [`forward_masked`](FlashMultiHeadAttention::forward_masked).
//!
//! What differs from Burn's module, because the fused kernel never materialises the attention
//! weights: `forward` returns the context only (no weights), and dropout applies to the
//! attention probabilities after the softmax (as PyTorch's and FlashAttention's), where Burn's
//! module drops the scores before it. Dropout acts in training only (an autodiff backend), as
//! Burn's `Dropout`.

use std::sync::atomic::{AtomicU64, Ordering};

use burn::config::Config;
use burn::module::{Initializer, Module};
use burn::nn::{DropoutConfig, Linear, LinearConfig};
use burn::tensor::activation::softmax;
use burn::tensor::module::{attention, attention_fallback};
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, DType, Device, Int, Tensor};

use crate::api::{AttentionMask, burn_attention, flash_attention_masked};
use crate::cache::KvCache;
use crate::error::FlashAttentionError;
use crate::options::{AttentionWindow, FlashAttentionOptions};
use crate::varlen::{PackedSequences, try_flash_attention_varlen};

/// Which implementation computes the attention inside [`FlashMultiHeadAttention`]. All four
/// compute the same function; they differ in speed, memory and rounding.
///
/// # Example
///
/// ```
/// use burn_flash::nn::{AttentionKernel, FlashMultiHeadAttentionConfig};
///
/// let config = FlashMultiHeadAttentionConfig::new(256, 4).with_kernel(AttentionKernel::Unfused);
/// assert_eq!(config.kernel, AttentionKernel::Unfused);
/// assert_eq!(FlashMultiHeadAttentionConfig::new(256, 4).kernel, AttentionKernel::Flash);
/// ```
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// [`flash_attention`](crate::flash_attention): the fused kernel (which itself takes Burn's
    /// unfused attention, with a logged warning, for inputs it cannot run).
    Flash,
    /// `burn::tensor::module::attention`: the backend's own attention operation.
    BurnBuiltin,
    /// `burn::tensor::module::attention_fallback`: matmul, softmax, matmul, holding the
    /// `seq_q × seq_k` scores.
    Unfused,
    /// [`Unfused`](Self::Unfused) in f32 whatever the model's dtype: the queries, keys, values
    /// and bias cast to f32 on the way in, the context cast back on the way out (the casts are
    /// differentiable). The slow, exactly rounded reference a bf16 or f16 training run of
    /// another kernel can be compared with.
    UnfusedF32,
}

/// Configuration of a [`FlashMultiHeadAttention`]; the fields of Burn's
/// `MultiHeadAttentionConfig` that apply, plus the attention features (`causal`, `n_kv_heads`,
/// `window_left`/`window_right`, `softcap`, `alibi`), `bias` and `kernel`.
///
/// # Example
///
/// ```no_run
/// use burn::tensor::Device;
/// use burn_flash::nn::{FlashMultiHeadAttention, FlashMultiHeadAttentionConfig};
///
/// // Mistral-style: 32 query heads over 8 key/value heads, causal, a 4096-token window.
/// let config = FlashMultiHeadAttentionConfig::new(4096, 32)
///     .with_n_kv_heads(Some(8))
///     .with_causal(true)
///     .with_window_left(Some(4095))
///     .with_dropout(0.0);
/// let attention: FlashMultiHeadAttention = config.init(&Device::wgpu(Default::default()));
/// assert_eq!((attention.d_k, attention.n_kv_heads), (128, 8));
/// ```
#[derive(Config, Debug)]
pub struct FlashMultiHeadAttentionConfig {
    /// Width of the inputs and outputs.
    pub d_model: usize,
    /// Number of heads; each has `d_model / n_heads` features.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention; 1 is multi-query): the key and value
    /// projections produce `n_kv_heads · d_k` features, each read by `n_heads / n_kv_heads`
    /// query heads. `None`: as many as query heads.
    #[config(default = "None")]
    pub n_kv_heads: Option<usize>,
    /// Apply the causal mask: position `i` attends to positions `j <= i` (aligned bottom-right
    /// when key and query lengths differ, see [`FlashAttentionOptions`]).
    #[config(default = false)]
    pub causal: bool,
    /// Keys before each query's diagonal that stay visible (a sliding window, see
    /// [`AttentionWindow`]); `None`: all of them. Mistral's window of `w` tokens is `w - 1`.
    #[config(default = "None")]
    pub window_left: Option<usize>,
    /// Keys after each query's diagonal that stay visible; `None`: all of them (the causal mask,
    /// if set, hides them anyway).
    #[config(default = "None")]
    pub window_right: Option<usize>,
    /// Cap the scaled scores at `±softcap` through `softcap · tanh(s / softcap)` (Gemma-2);
    /// `None`: no cap.
    #[config(default = "None")]
    pub softcap: Option<f64>,
    /// Add ALiBi's linear biases (the paper's slopes for `n_heads`), computed in the kernel.
    #[config(default = false)]
    pub alibi: bool,
    /// Dropout probability of the attention probabilities, in training (see the module's
    /// documentation); Burn's default.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Whether the four projections have a bias.
    #[config(default = true)]
    pub bias: bool,
    /// Which implementation computes the attention.
    #[config(default = "AttentionKernel::Flash")]
    pub kernel: AttentionKernel,
    /// Initializer of the projections' weights and biases (Burn's default for `Linear`).
    #[config(default = "Initializer::KaimingUniform{gain:1.0/3.0f64.sqrt(), fan_out_only:false}")]
    pub initializer: Initializer,
}

/// Multi-head attention over `[batch, seq, d_model]` inputs: project to heads, attend with the
/// chosen [`AttentionKernel`], concatenate the heads and project back.
///
/// # Example
///
/// ```no_run
/// use burn::tensor::{Device, Distribution, Tensor};
/// use burn_flash::nn::FlashMultiHeadAttentionConfig;
///
/// let device = Device::wgpu(Default::default());
/// let attention = FlashMultiHeadAttentionConfig::new(256, 4)
///     .with_causal(true)
///     .init(&device);
/// let x = Tensor::<3>::random([2, 128, 256], Distribution::Normal(0.0, 1.0), &device);
/// let y = attention.forward_self(x); // [2, 128, 256]
/// ```
#[derive(Module, Debug)]
pub struct FlashMultiHeadAttention {
    /// Query projection, `d_model → n_heads · d_k`.
    pub query: Linear,
    /// Key projection, `d_model → n_kv_heads · d_k`.
    pub key: Linear,
    /// Value projection, `d_model → n_kv_heads · d_k`.
    pub value: Linear,
    /// Output projection.
    pub output: Linear,
    /// Dropout probability of the attention probabilities in training.
    pub dropout: f64,
    /// Width of the inputs and outputs.
    pub d_model: usize,
    /// Number of query heads.
    pub n_heads: usize,
    /// Number of key/value heads (divides `n_heads`).
    pub n_kv_heads: usize,
    /// Features per head, `d_model / n_heads`.
    pub d_k: usize,
    /// The attention's options: causal mask, window, softcap (scale `1 / sqrt(d_k)`); may be
    /// changed after loading weights.
    #[module(skip)]
    pub options: FlashAttentionOptions,
    /// Which implementation computes the attention; may be changed after loading weights.
    #[module(skip)]
    pub kernel: AttentionKernel,
}

impl FlashMultiHeadAttentionConfig {
    /// A module with freshly initialized weights on `device`.
    ///
    /// # Panics
    ///
    /// If `n_heads` is 0 or does not divide `d_model`, or `n_kv_heads` is 0 or does not divide
    /// `n_heads`.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use burn::tensor::Device;
    /// use burn_flash::nn::FlashMultiHeadAttentionConfig;
    ///
    /// let attention = FlashMultiHeadAttentionConfig::new(768, 12).init(&Device::wgpu(Default::default()));
    /// assert_eq!(attention.n_heads, 12);
    /// ```
    pub fn init(&self, device: &Device) -> FlashMultiHeadAttention {
        assert!(
            self.n_heads > 0 && self.d_model.is_multiple_of(self.n_heads),
            "n_heads ({}) must divide d_model ({})",
            self.n_heads,
            self.d_model
        );
        let n_kv_heads = self.n_kv_heads.unwrap_or(self.n_heads);
        assert!(
            n_kv_heads > 0 && self.n_heads.is_multiple_of(n_kv_heads),
            "n_kv_heads ({n_kv_heads}) must divide n_heads ({})",
            self.n_heads
        );
        let d_k = self.d_model / self.n_heads;
        let linear = |d_out| {
            LinearConfig::new(self.d_model, d_out)
                .with_bias(self.bias)
                .with_initializer(self.initializer.clone())
                .init(device)
        };
        let mut options = FlashAttentionOptions::new()
            .with_causal(self.causal)
            .with_alibi(self.alibi);
        if self.window_left.is_some() || self.window_right.is_some() {
            options =
                options.with_window(AttentionWindow::new(self.window_left, self.window_right));
        }
        if let Some(softcap) = self.softcap {
            options = options.with_softcap(softcap);
        }
        FlashMultiHeadAttention {
            query: linear(self.d_model),
            key: linear(n_kv_heads * d_k),
            value: linear(n_kv_heads * d_k),
            output: linear(self.d_model),
            dropout: self.dropout,
            d_model: self.d_model,
            n_heads: self.n_heads,
            n_kv_heads,
            d_k,
            options,
            kernel: self.kernel,
        }
    }
}

impl FlashMultiHeadAttention {
    /// Attention of `query: [batch, seq_q, d_model]` over `key` and `value:
    /// [batch, seq_k, d_model]`; returns `[batch, seq_q, d_model]`.
    ///
    /// # Example
    ///
    /// ```
    /// use burn::tensor::Tensor;
    /// use burn_flash::nn::FlashMultiHeadAttention;
    ///
    /// fn cross(
    ///     attention: &FlashMultiHeadAttention,
    ///     decoder: Tensor<3>,
    ///     encoder: Tensor<3>,
    /// ) -> Tensor<3> {
    ///     attention.forward(decoder, encoder.clone(), encoder)
    /// }
    /// ```
    pub fn forward(&self, query: Tensor<3>, key: Tensor<3>, value: Tensor<3>) -> Tensor<3> {
        self.forward_masked(query, key, value, None, None)
    }

    /// [`forward`](Self::forward) with a boolean mask (`true` hides a pair; e.g.
    /// [`AttentionMask::KeyPadding`] of `[batch, seq_k]`) and an additive bias
    /// `[batch|1, n_heads|1, seq_q|1, seq_k]` on the scores, as
    /// [`flash_attention_masked`] takes them. Rows that see no key give a context of 0.
    ///
    /// # Panics
    ///
    /// On a mask or bias [`try_flash_attention_masked`](crate::try_flash_attention_masked)
    /// refuses.
    ///
    /// # Example
    ///
    /// ```
    /// use burn::tensor::{Bool, Tensor};
    /// use burn_flash::nn::FlashMultiHeadAttention;
    /// use burn_flash::AttentionMask;
    ///
    /// /// `padding: [batch, seq]`, true on padding tokens.
    /// fn encode(
    ///     attention: &FlashMultiHeadAttention,
    ///     x: Tensor<3>,
    ///     padding: Tensor<2, Bool>,
    /// ) -> Tensor<3> {
    ///     let mask = Some(AttentionMask::KeyPadding(padding));
    ///     attention.forward_masked(x.clone(), x.clone(), x, mask, None)
    /// }
    /// ```
    pub fn forward_masked(
        &self,
        query: Tensor<3>,
        key: Tensor<3>,
        value: Tensor<3>,
        mask: Option<AttentionMask>,
        bias: Option<Tensor<4>>,
    ) -> Tensor<3> {
        let [batch, seq_q, _] = query.dims();
        let q = self.split_heads(self.query.forward(query), self.n_heads);
        let k = self.split_heads(self.key.forward(key), self.n_kv_heads);
        let v = self.split_heads(self.value.forward(value), self.n_kv_heads);
        let context = self
            .attend_masked(q, k, v, mask, bias)
            .swap_dims(1, 2)
            .reshape([batch, seq_q, self.d_model]);
        self.output.forward(context)
    }

    /// Self-attention: [`forward`](Self::forward) with `x` as query, key and value.
    ///
    /// # Example
    ///
    /// ```
    /// use burn::tensor::Tensor;
    /// use burn_flash::nn::FlashMultiHeadAttention;
    ///
    /// fn block(attention: &FlashMultiHeadAttention, x: Tensor<3>) -> Tensor<3> {
    ///     x.clone() + attention.forward_self(x)
    /// }
    /// ```
    pub fn forward_self(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward(x.clone(), x.clone(), x)
    }

    /// The attention of per-head `q: [batch, n_heads, seq_q, d_k]`, `k`, `v: [batch,
    /// n_kv_heads, seq_k, d_k]` with this module's kernel and options (scale `1 / sqrt(d_k)`),
    /// without the projections.
    ///
    /// # Example
    ///
    /// ```
    /// use burn::tensor::Tensor;
    /// use burn_flash::nn::FlashMultiHeadAttention;
    ///
    /// fn heads_only(
    ///     attention: &FlashMultiHeadAttention,
    ///     qkv: Tensor<4>,
    /// ) -> Tensor<4> {
    ///     attention.attend(qkv.clone(), qkv.clone(), qkv)
    /// }
    /// ```
    pub fn attend(&self, q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
        self.attend_masked(q, k, v, None, None)
    }

    /// [`attend`](Self::attend) with a mask and a bias, as
    /// [`forward_masked`](Self::forward_masked) takes them.
    ///
    /// # Example
    ///
    /// ```
    /// use burn::tensor::Tensor;
    /// use burn_flash::nn::FlashMultiHeadAttention;
    ///
    /// /// `bias: [1, heads, seq, seq]`, e.g. relative positions.
    /// fn biased(
    ///     attention: &FlashMultiHeadAttention,
    ///     qkv: Tensor<4>,
    ///     bias: Tensor<4>,
    /// ) -> Tensor<4> {
    ///     attention.attend_masked(qkv.clone(), qkv.clone(), qkv, None, Some(bias))
    /// }
    /// ```
    pub fn attend_masked(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        mask: Option<AttentionMask>,
        bias: Option<Tensor<4>>,
    ) -> Tensor<4> {
        let options = self.options;
        let dropout = (q.device().is_autodiff() && self.dropout > 0.0).then_some(self.dropout);
        let dtype = q.dtype();
        let (q, k, v, bias) = match self.kernel {
            AttentionKernel::UnfusedF32 => {
                let [q, k, v] = [q, k, v].map(|t| t.cast(DType::F32));
                (q, k, v, bias.map(|b| b.cast(DType::F32)))
            }
            _ => (q, k, v, bias),
        };
        let context = match (self.kernel, dropout) {
            (AttentionKernel::Flash, None) => flash_attention_masked(q, k, v, mask, bias, options),
            (AttentionKernel::Flash, Some(prob)) => {
                let options = options.with_dropout(prob, next_dropout_seed());
                flash_attention_masked(q, k, v, mask, bias, options)
            }
            (AttentionKernel::BurnBuiltin, None) => {
                burn_attention(q, k, v, mask, bias, options, attention)
            }
            (AttentionKernel::Unfused | AttentionKernel::UnfusedF32, None) => {
                burn_attention(q, k, v, mask, bias, options, attention_fallback)
            }
            // Burn's attention operations have no dropout: both compute the unfused attention
            // with Burn's `Dropout` on the probabilities.
            (_, Some(prob)) => burn_attention(q, k, v, mask, bias, options, |q, k, v, m, b, o| {
                unfused_with_dropout(q, k, v, m, b, o, prob)
            }),
        };
        if context.dtype() == dtype {
            context
        } else {
            context.cast(dtype)
        }
    }

    /// Self-attention of the newest positions `x: [batch, n, d_model]` of each sequence over
    /// its earlier ones in `cache` and themselves: their keys and values are appended to the
    /// cache, then their queries attend over each sequence's filled part ([`KvCache::attend`],
    /// with this module's options: causal per sequence where the module is causal). Returns
    /// `[batch, n, d_model]`: what [`forward_self`](Self::forward_self) of the whole sequences
    /// gives at those positions, without recomputing the earlier ones. Always the fused kernel
    /// (the cache is its input), whatever [`kernel`](Self::kernel) says.
    ///
    /// # Errors
    ///
    /// Those of [`KvCache::append`] and [`KvCache::attend`]: a cache of another batch, heads,
    /// head dim, dtype or device than this module's projections give, or one that is full.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use burn::tensor::{DType, Device, Distribution, Tensor};
    /// use burn_flash::KvCache;
    /// use burn_flash::nn::FlashMultiHeadAttentionConfig;
    ///
    /// let device = Device::wgpu(Default::default());
    /// let attention = FlashMultiHeadAttentionConfig::new(256, 8).with_causal(true).init(&device);
    /// let mut cache = KvCache::new([1, 8, 512, 32], 32, DType::F32, &device);
    /// let prompt = Tensor::<3>::random([1, 20, 256], Distribution::Normal(0.0, 1.0), &device);
    /// let _ = attention.forward_cached(prompt, &mut cache).unwrap();
    /// let next = Tensor::<3>::random([1, 1, 256], Distribution::Normal(0.0, 1.0), &device);
    /// let y = attention.forward_cached(next, &mut cache).unwrap(); // [1, 1, 256]
    /// ```
    pub fn forward_cached(
        &self,
        x: Tensor<3>,
        cache: &mut KvCache,
    ) -> Result<Tensor<3>, FlashAttentionError> {
        let [batch, n, _] = x.dims();
        let q = self.split_heads(self.query.forward(x.clone()), self.n_heads);
        let k = self.split_heads(self.key.forward(x.clone()), self.n_kv_heads);
        let v = self.split_heads(self.value.forward(x), self.n_kv_heads);
        let context = cache
            .append_and_attend(q, k, v, self.options)?
            .swap_dims(1, 2)
            .reshape([batch, n, self.d_model]);
        Ok(self.output.forward(context))
    }

    /// Self-attention over a batch of sequences of different lengths packed along the rows
    /// (`x: [total, d_model]`, sequence `b` in the rows `sequences` gives it; see
    /// [`PackedSequences`]): each sequence attends to itself only, with this module's options
    /// (causal per sequence where the module is causal), and no position is padded. Returns
    /// `[total, d_model]`, row for row what [`forward_self`](Self::forward_self) gives each
    /// sequence alone. Always the fused kernel through
    /// [`try_flash_attention_varlen`](crate::try_flash_attention_varlen), whatever
    /// [`kernel`](Self::kernel) says; with dropout in training (an autodiff device), the
    /// fused kernel's dropout.
    ///
    /// # Errors
    ///
    /// Those of [`try_flash_attention_varlen`](crate::try_flash_attention_varlen): rows that do
    /// not add up to `sequences`, or `sequences` on another device.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use burn::tensor::{Device, Distribution, Tensor};
    /// use burn_flash::nn::FlashMultiHeadAttentionConfig;
    /// use burn_flash::PackedSequences;
    ///
    /// let device = Device::wgpu(Default::default());
    /// let attention = FlashMultiHeadAttentionConfig::new(256, 4)
    ///     .with_causal(true)
    ///     .init(&device);
    /// // Documents of 120, 7 and 300 tokens, packed without padding.
    /// let packed = PackedSequences::new(&[120, 7, 300], &device);
    /// let x = Tensor::<2>::random([427, 256], Distribution::Normal(0.0, 1.0), &device);
    /// let y = attention.forward_packed(x, &packed).unwrap(); // [427, 256]
    /// ```
    pub fn forward_packed(
        &self,
        x: Tensor<2>,
        sequences: &PackedSequences,
    ) -> Result<Tensor<2>, FlashAttentionError> {
        let [total, _] = x.dims();
        let heads = |x: Tensor<2>, heads| x.reshape([total, heads, self.d_k]);
        let q = heads(self.query.forward(x.clone()), self.n_heads);
        let k = heads(self.key.forward(x.clone()), self.n_kv_heads);
        let v = heads(self.value.forward(x), self.n_kv_heads);
        let options = if q.device().is_autodiff() && self.dropout > 0.0 {
            self.options.with_dropout(self.dropout, next_dropout_seed())
        } else {
            self.options
        };
        let context =
            try_flash_attention_varlen(q, k, v, sequences, options)?.reshape([total, self.d_model]);
        Ok(self.output.forward(context))
    }

    /// `[batch, seq, heads · d_k]` to `[batch, heads, seq, d_k]`.
    fn split_heads(&self, x: Tensor<3>, heads: usize) -> Tensor<4> {
        let [batch, seq, _] = x.dims();
        x.reshape([batch, seq, heads, self.d_k]).swap_dims(1, 2)
    }
}

/// The unfused attention (`softmax(scale · Q·Kᵀ, capped, masked, biased) · V`) with Burn's
/// `Dropout` on the probabilities: the non-fused kernels' training path. Rows that see no key
/// give 0, as in Burn's fallback.
fn unfused_with_dropout(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<4, Bool>>,
    bias: Option<Tensor<4>>,
    options: AttentionModuleOptions,
    prob: f64,
) -> Tensor<4> {
    let [_, _, seq_q, head_dim] = q.dims();
    let seq_k = k.dims()[2];
    let scale = options.scale.unwrap_or(1.0 / (head_dim as f64).sqrt());
    let mut scores = q.matmul(k.transpose()).mul_scalar(scale);
    if let Some(cap) = options.softcap {
        scores = scores.div_scalar(cap).tanh().mul_scalar(cap);
    }
    if options.is_causal {
        // Bottom-right aligned: query i sees key j <= i + seq_k - seq_q.
        let device = scores.device();
        let keys = Tensor::<1, Int>::arange(0..seq_k as i64, &device).unsqueeze::<2>();
        let diagonals = Tensor::<1, Int>::arange(0..seq_q as i64, &device)
            .add_scalar(seq_k as i64 - seq_q as i64)
            .unsqueeze_dim::<2>(1);
        let future = keys.greater(diagonals);
        scores = scores.mask_fill(future.unsqueeze::<4>(), f32::NEG_INFINITY);
    }
    if let Some(mask) = mask {
        scores = scores.mask_fill(mask, f32::NEG_INFINITY);
    }
    if let Some(bias) = bias {
        scores = scores + bias;
    }
    // A row that sees nothing is all -inf: its softmax is NaN, its output 0.
    let empty = scores.clone().equal_elem(f32::NEG_INFINITY).all_dim(3);
    let probs = softmax(scores, 3).mask_fill(empty, 0.0);
    DropoutConfig::new(prob).init().forward(probs).matmul(v)
}

/// The seed of the next call's dropout mask: a process-wide stream, restarted by
/// [`seed_dropout`].
fn next_dropout_seed() -> u64 {
    // splitmix64 over a Weyl sequence.
    let mut z = DROPOUT_STREAM.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

static DROPOUT_STREAM: AtomicU64 = AtomicU64::new(0);

/// Restart the stream of dropout seeds that [`FlashMultiHeadAttention`] draws from, one per
/// call of the fused kernel, so that a training run repeats its masks (Burn's `B::seed` seeds
/// the other kernels' `Dropout`).
///
/// # Example
///
/// ```
/// burn_flash::nn::seed_dropout(42);
/// ```
pub fn seed_dropout(seed: u64) {
    DROPOUT_STREAM.store(seed, Ordering::Relaxed);
}
