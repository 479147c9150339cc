//! The options of one attention call.

use burn::tensor::ops::AttentionModuleOptions;

/// Options of [`flash_attention`](crate::flash_attention): causal masking and the softmax scale.
///
/// The conventions are those of Burn's `burn::tensor::module::attention`:
///
/// - `causal`: query `i` sees key `j` when `j <= i + (seq_k - seq_q)`, i.e. the mask is aligned
///   to the bottom-right corner of the score matrix. With `seq_k == seq_q` this is the usual
///   lower-triangular mask; with `seq_k > seq_q` (a decoder step over a KV cache) every query sees
///   the whole prefix. A query row that sees no key at all (possible when `seq_k < seq_q`) gets
///   an output of 0, not NaN.
/// - `scale`: the factor applied to `Q·Kᵀ` before the softmax; `None` means
///   `1 / sqrt(head_dim)`. It must be finite and positive.
///
/// The default is not causal, with the default scale.
///
/// # Example
///
/// ```
/// use burn_flash::FlashAttentionOptions;
///
/// let options = FlashAttentionOptions::causal().with_scale(0.125);
/// assert!(options.causal);
/// assert_eq!(options.scale, Some(0.125));
/// assert_eq!(FlashAttentionOptions::default().scale_for(64), 0.125);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FlashAttentionOptions {
    /// Apply the causal mask, aligned bottom-right (see the type's documentation).
    pub causal: bool,
    /// Scale applied to `Q·Kᵀ`; `None` means `1 / sqrt(head_dim)`.
    pub scale: Option<f64>,
}

impl FlashAttentionOptions {
    /// Not causal, default scale; the same as [`Default::default`].
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::FlashAttentionOptions;
    ///
    /// assert_eq!(FlashAttentionOptions::new(), FlashAttentionOptions::default());
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Causal, default scale.
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::FlashAttentionOptions;
    ///
    /// let options = FlashAttentionOptions::causal();
    /// assert!(options.causal && options.scale.is_none());
    /// ```
    pub fn causal() -> Self {
        Self {
            causal: true,
            scale: None,
        }
    }

    /// These options with causal masking switched on or off.
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::FlashAttentionOptions;
    ///
    /// let options = FlashAttentionOptions::new().with_causal(true);
    /// assert_eq!(options, FlashAttentionOptions::causal());
    /// ```
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// These options with an explicit scale for `Q·Kᵀ` (finite and positive, checked when the
    /// attention runs).
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::FlashAttentionOptions;
    ///
    /// let options = FlashAttentionOptions::new().with_scale(0.1);
    /// assert_eq!(options.scale, Some(0.1));
    /// ```
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }

    /// The scale that applies to inputs of this head dim: the explicit one, or
    /// `1 / sqrt(head_dim)`.
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::FlashAttentionOptions;
    ///
    /// assert_eq!(FlashAttentionOptions::new().scale_for(16), 0.25);
    /// assert_eq!(FlashAttentionOptions::new().with_scale(2.0).scale_for(16), 2.0);
    /// ```
    pub fn scale_for(&self, head_dim: usize) -> f64 {
        self.scale.unwrap_or_else(|| 1.0 / (head_dim as f64).sqrt())
    }
}

impl From<FlashAttentionOptions> for AttentionModuleOptions {
    /// The equivalent options of Burn's own attention (no softcap).
    ///
    /// # Example
    ///
    /// ```
    /// use burn::tensor::ops::AttentionModuleOptions;
    /// use burn_flash::FlashAttentionOptions;
    ///
    /// let burn: AttentionModuleOptions = FlashAttentionOptions::causal().into();
    /// assert!(burn.is_causal && burn.scale.is_none() && burn.softcap.is_none());
    /// ```
    fn from(options: FlashAttentionOptions) -> Self {
        AttentionModuleOptions {
            scale: options.scale,
            softcap: None,
            is_causal: options.causal,
        }
    }
}
