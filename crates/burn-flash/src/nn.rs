//! Modules for models: multi-head attention whose core is the fused kernel.
//!
//! [`FlashMultiHeadAttention`] stands where `burn::nn::attention::MultiHeadAttention` would: the
//! same four projections (`query`, `key`, `value`, `output`, each `d_model × d_model`), the
//! same configuration fields, and a choice of [`AttentionKernel`] for the
//! `softmax(Q·Kᵀ / sqrt(d_k)) · V` in the middle, so one model can be run with the fused kernel,
//! Burn's own attention or the unfused computation on the same weights.
//!
//! What differs from Burn's module, because the fused kernel never materialises the attention
//! weights: `forward` returns the context only (no weights), masking is causal or none (no
//! padding or arbitrary masks), and dropout applies to the module's output rather than to the
//! attention scores.

use burn::config::Config;
use burn::module::{Initializer, Module};
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig};
use burn::tensor::Tensor;
use burn::tensor::module::{attention, attention_fallback};

use crate::{FlashAttentionBackend, FlashAttentionOptions, flash_attention};

/// Which implementation computes the attention inside [`FlashMultiHeadAttention`]. All three
/// compute the same function; they differ in speed and memory.
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
}

/// Configuration of a [`FlashMultiHeadAttention`]; the fields of Burn's
/// `MultiHeadAttentionConfig` that apply, plus `causal`, `bias` and `kernel`.
///
/// # Example
///
/// ```no_run
/// use burn::backend::Wgpu;
/// use burn_flash::nn::{FlashMultiHeadAttention, FlashMultiHeadAttentionConfig};
///
/// let config = FlashMultiHeadAttentionConfig::new(512, 8).with_causal(true).with_dropout(0.0);
/// let attention: FlashMultiHeadAttention<Wgpu> = config.init(&Default::default());
/// assert_eq!(attention.d_k, 64);
/// ```
#[derive(Config, Debug)]
pub struct FlashMultiHeadAttentionConfig {
    /// Width of the inputs and outputs.
    pub d_model: usize,
    /// Number of heads; each has `d_model / n_heads` features.
    pub n_heads: usize,
    /// Apply the causal mask: position `i` attends to positions `j <= i` (aligned bottom-right
    /// when key and query lengths differ, see [`FlashAttentionOptions`]).
    #[config(default = false)]
    pub causal: bool,
    /// Dropout probability applied to the output (after the output projection) in training.
    /// Burn's module drops attention scores instead; the fused kernel has no such dropout.
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
/// use burn::backend::Wgpu;
/// use burn::tensor::{Distribution, Tensor};
/// use burn_flash::nn::FlashMultiHeadAttentionConfig;
///
/// let device = Default::default();
/// let attention = FlashMultiHeadAttentionConfig::new(256, 4)
///     .with_causal(true)
///     .init::<Wgpu>(&device);
/// let x = Tensor::<Wgpu, 3>::random([2, 128, 256], Distribution::Normal(0.0, 1.0), &device);
/// let y = attention.forward_self(x); // [2, 128, 256]
/// ```
#[derive(Module, Debug)]
pub struct FlashMultiHeadAttention<B: FlashAttentionBackend> {
    /// Query projection.
    pub query: Linear<B>,
    /// Key projection.
    pub key: Linear<B>,
    /// Value projection.
    pub value: Linear<B>,
    /// Output projection.
    pub output: Linear<B>,
    /// Dropout on the output.
    pub dropout: Dropout,
    /// Width of the inputs and outputs.
    pub d_model: usize,
    /// Number of heads.
    pub n_heads: usize,
    /// Features per head, `d_model / n_heads`.
    pub d_k: usize,
    /// Whether the causal mask applies.
    pub causal: bool,
    /// Which implementation computes the attention; may be changed after loading weights.
    pub kernel: AttentionKernel,
}

impl FlashMultiHeadAttentionConfig {
    /// A module with freshly initialized weights on `device`.
    ///
    /// # Panics
    ///
    /// If `n_heads` is 0 or does not divide `d_model`.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use burn::backend::Wgpu;
    /// use burn_flash::nn::FlashMultiHeadAttentionConfig;
    ///
    /// let attention = FlashMultiHeadAttentionConfig::new(768, 12).init::<Wgpu>(&Default::default());
    /// assert_eq!(attention.n_heads, 12);
    /// ```
    pub fn init<B: FlashAttentionBackend>(&self, device: &B::Device) -> FlashMultiHeadAttention<B> {
        assert!(
            self.n_heads > 0 && self.d_model.is_multiple_of(self.n_heads),
            "n_heads ({}) must divide d_model ({})",
            self.n_heads,
            self.d_model
        );
        let linear = || {
            LinearConfig::new(self.d_model, self.d_model)
                .with_bias(self.bias)
                .with_initializer(self.initializer.clone())
                .init(device)
        };
        FlashMultiHeadAttention {
            query: linear(),
            key: linear(),
            value: linear(),
            output: linear(),
            dropout: DropoutConfig::new(self.dropout).init(),
            d_model: self.d_model,
            n_heads: self.n_heads,
            d_k: self.d_model / self.n_heads,
            causal: self.causal,
            kernel: self.kernel,
        }
    }
}

impl<B: FlashAttentionBackend> FlashMultiHeadAttention<B> {
    /// Attention of `query: [batch, seq_q, d_model]` over `key` and `value:
    /// [batch, seq_k, d_model]`; returns `[batch, seq_q, d_model]`.
    ///
    /// # Example
    ///
    /// ```
    /// use burn::tensor::Tensor;
    /// use burn_flash::nn::FlashMultiHeadAttention;
    /// use burn_flash::FlashAttentionBackend;
    ///
    /// fn cross<B: FlashAttentionBackend>(
    ///     attention: &FlashMultiHeadAttention<B>,
    ///     decoder: Tensor<B, 3>,
    ///     encoder: Tensor<B, 3>,
    /// ) -> Tensor<B, 3> {
    ///     attention.forward(decoder, encoder.clone(), encoder)
    /// }
    /// ```
    pub fn forward(
        &self,
        query: Tensor<B, 3>,
        key: Tensor<B, 3>,
        value: Tensor<B, 3>,
    ) -> Tensor<B, 3> {
        let [batch, seq_q, _] = query.dims();
        let q = self.split_heads(self.query.forward(query));
        let k = self.split_heads(self.key.forward(key));
        let v = self.split_heads(self.value.forward(value));
        let context = self
            .attend(q, k, v)
            .swap_dims(1, 2)
            .reshape([batch, seq_q, self.d_model]);
        self.dropout.forward(self.output.forward(context))
    }

    /// Self-attention: [`forward`](Self::forward) with `x` as query, key and value.
    ///
    /// # Example
    ///
    /// ```
    /// use burn::tensor::Tensor;
    /// use burn_flash::nn::FlashMultiHeadAttention;
    /// use burn_flash::FlashAttentionBackend;
    ///
    /// fn block<B: FlashAttentionBackend>(attention: &FlashMultiHeadAttention<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
    ///     x.clone() + attention.forward_self(x)
    /// }
    /// ```
    pub fn forward_self(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.forward(x.clone(), x.clone(), x)
    }

    /// The attention of per-head `q: [batch, heads, seq_q, d_k]`, `k`, `v: [batch, heads,
    /// seq_k, d_k]` with this module's kernel and mask (scale `1 / sqrt(d_k)`), without the
    /// projections.
    ///
    /// # Example
    ///
    /// ```
    /// use burn::tensor::Tensor;
    /// use burn_flash::nn::FlashMultiHeadAttention;
    /// use burn_flash::FlashAttentionBackend;
    ///
    /// fn heads_only<B: FlashAttentionBackend>(
    ///     attention: &FlashMultiHeadAttention<B>,
    ///     qkv: Tensor<B, 4>,
    /// ) -> Tensor<B, 4> {
    ///     attention.attend(qkv.clone(), qkv.clone(), qkv)
    /// }
    /// ```
    pub fn attend(&self, q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Tensor<B, 4> {
        let options = FlashAttentionOptions::new().with_causal(self.causal);
        match self.kernel {
            AttentionKernel::Flash => flash_attention(q, k, v, options),
            AttentionKernel::BurnBuiltin => attention(q, k, v, None, None, options.into()),
            AttentionKernel::Unfused => attention_fallback(q, k, v, None, None, options.into()),
        }
    }

    /// `[batch, seq, d_model]` to `[batch, heads, seq, d_k]`.
    fn split_heads(&self, x: Tensor<B, 3>) -> Tensor<B, 4> {
        let [batch, seq, _] = x.dims();
        x.reshape([batch, seq, self.n_heads, self.d_k])
            .swap_dims(1, 2)
    }
}
