//! The options of one attention call.

pub use burn::tensor::ops::CausalAlignment;

/// Options of [`flash_attention`](crate::flash_attention): causal masking, sliding window, the
/// softmax scale, the softcap, ALiBi, dropout, and whether the backward must be deterministic.
///
/// The conventions are those of Burn's `burn::tensor::module::attention`:
///
/// - `causal`: query `i` sees key `j` when `j <= diag(i)`, its diagonal. By default (Burn's
///   [`CausalAlignment::BottomRight`]) `diag(i) = i + (seq_k - seq_q)`: the mask is aligned to the
///   bottom-right corner of the score matrix, so with `seq_k > seq_q` (a decoder step over a KV
///   cache) every query sees the whole prefix. `causal_alignment`
///   ([`CausalAlignment::TopLeft`], PyTorch's `is_causal`) makes it `diag(i) = i`. With
///   `seq_k == seq_q` both are the usual lower-triangular mask. A query row that sees no key at
///   all (possible when `seq_k < seq_q`) gets an output of 0, not NaN.
/// - `causal_alignment`: where the diagonal of every band lies (the causal mask's, the window's
///   and ALiBi's), as Burn's `AttentionModuleOptions::causal_alignment`.
/// - `scale`: the factor applied to `Q·Kᵀ` before the softmax; `None` means
///   `1 / sqrt(head_dim)`. It must be finite and positive.
/// - `window`: a band of keys around each query's diagonal (`diag(i)`, as the causal mask's);
///   keys outside it are hidden. See [`AttentionWindow`]. Combined with `causal`, the band ends
///   at the diagonal.
/// - `softcap`: scores become `softcap · tanh(scale · q·k / softcap)` before the softmax
///   (Gemma-2), as Burn's `AttentionModuleOptions::softcap`. It must be finite and positive.
/// - `alibi`: ALiBi's linear biases, `−slope_h · |j − diag(i)|` added to the scaled scores of
///   query head `h` (with the causal mask, `slope_h · (j − diag(i))`, as in the paper), the
///   slopes of Press et al. for the query head count ([`alibi_slopes`]). Computed in the
///   kernels from the head index: nothing is read, and it combines with a bias input.
/// - `dropout`: each attention probability is zeroed with probability `prob` and the kept ones
///   are scaled by `1 / (1 − prob)`, after the softmax (the normaliser and the saved
///   log-sum-exp are those of the whole row), as PyTorch's and FlashAttention's dropout. The
///   decisions come from a counter-based generator seeded by `seed`: the same seed gives the
///   same mask, the backward regenerates it, and nothing is stored. See [`AttentionDropout`].
/// - `deterministic` (default `true`): the fused backward computes dQ in its own pass, so
///   repeated runs give identical bits. `false` allows FlashAttention-2's scheme instead, each
///   key block adding its share of dQ with f32 atomics, and the backward takes whichever of the
///   two is faster for the shape, as measured on the H100 (`docs/backward.md`): the atomic one
///   from head dim 128 over at least 1024 keys (2048 when causal), where it is 4–15 % faster;
///   dQ's own pass below that, at head dim 64 and on the portable tile. Runtimes without f32
///   atomic add always take dQ's own pass.
///
/// The default is not causal, no window, the default scale, no softcap, no ALiBi, no dropout,
/// deterministic dQ. The type may gain fields: build it with [`new`](Self::new) or
/// [`causal`](Self::causal) and the `with_*` methods.
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
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct FlashAttentionOptions {
    /// Apply the causal mask (see the type's documentation).
    pub causal: bool,
    /// Where each query's diagonal lies when `seq_q != seq_k`: bottom-right (Burn's default) or
    /// top-left. It places the causal mask, the window and ALiBi alike.
    pub causal_alignment: CausalAlignment,
    /// Scale applied to `Q·Kᵀ`; `None` means `1 / sqrt(head_dim)`.
    pub scale: Option<f64>,
    /// Hide keys outside a band around each query's diagonal; `None`: no band.
    pub window: Option<AttentionWindow>,
    /// Cap the scaled scores at `±softcap` through `softcap · tanh(s / softcap)`; `None`: no cap.
    pub softcap: Option<f64>,
    /// Add ALiBi's linear biases with the standard slopes for the query head count.
    pub alibi: bool,
    /// Drop attention probabilities; `None` (or a probability of 0): no dropout.
    pub dropout: Option<AttentionDropout>,
    /// The backward sums dQ in its own launch in a fixed order (`true`, the default), or
    /// (`false`) may add it by f32 atomics from the key-block launch where that is faster.
    pub deterministic: bool,
}

impl Default for FlashAttentionOptions {
    fn default() -> Self {
        Self {
            causal: false,
            causal_alignment: CausalAlignment::BottomRight,
            scale: None,
            window: None,
            softcap: None,
            alibi: false,
            dropout: None,
            deterministic: true,
        }
    }
}

/// Dropout of the attention probabilities: each (batch, head, query, key) probability is zeroed
/// with probability `prob`, and kept ones are scaled so that every output is unbiased.
///
/// The decisions are a pure function of `seed` and the position, computed where each
/// probability is formed (forward and backward alike; nothing is stored): a keyed 32-bit
/// integer hash of the position gives 8 random bits per pair (one hash for four keys of a
/// query), compared with [`keep_threshold`](Self::keep_threshold). The keep probability is
/// therefore `1 − prob` rounded to a multiple of 2⁻⁸ (as FlashAttention-2 quantises it), and
/// kept probabilities are scaled by its inverse, so outputs stay unbiased. Within one head the
/// random bits never repeat while `seq_q · 4⌈seq_k / 16⌉ ≤ 2³²` (e.g. 65536 × 262144); beyond
/// it they wrap. The exact formula is in `docs/features.md`.
///
/// Use a new seed for every call that should draw a new mask (every training step, every
/// layer); [`FlashMultiHeadAttention`](crate::nn::FlashMultiHeadAttention) does.
///
/// # Example
///
/// ```
/// use burn_flash::{AttentionDropout, FlashAttentionOptions};
///
/// let options = FlashAttentionOptions::causal().with_dropout(0.1, 42);
/// assert_eq!(options.dropout, Some(AttentionDropout { prob: 0.1, seed: 42 }));
/// assert_eq!(AttentionDropout { prob: 0.1, seed: 42 }.keep_threshold(), 230);
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDropout {
    /// Probability of zeroing each attention probability, in `[0, 1)`.
    pub prob: f64,
    /// Seed of the mask.
    pub seed: u64,
}

impl AttentionDropout {
    /// Kept pairs are those whose 8 random bits are below this: `round((1 − prob) · 2⁸)`, at
    /// least 1, and at most 255 when `prob > 0`, so that any positive `prob` drops something
    /// (2⁻⁸ for `prob` below 2⁻⁹).
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::AttentionDropout;
    ///
    /// assert_eq!(AttentionDropout { prob: 0.5, seed: 0 }.keep_threshold(), 128);
    /// assert_eq!(AttentionDropout { prob: 0.001, seed: 0 }.keep_threshold(), 255);
    /// assert_eq!(AttentionDropout { prob: 0.0, seed: 0 }.keep_threshold(), 256);
    /// ```
    pub fn keep_threshold(&self) -> u32 {
        let most = if self.prob > 0.0 { 255 } else { 256 };
        (((1.0 - self.prob) * 256.0).round() as u32).clamp(1, most)
    }

    /// Whether any probability can be dropped (`prob > 0`).
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::AttentionDropout;
    ///
    /// assert!(AttentionDropout { prob: 0.1, seed: 0 }.is_active());
    /// assert!(!AttentionDropout { prob: 0.0, seed: 0 }.is_active());
    /// ```
    pub fn is_active(&self) -> bool {
        self.keep_threshold() < 256
    }
}

/// A band of visible keys around each query's diagonal (local, or sliding-window, attention):
/// query `i` sees key `j` when `diag - left <= j <= diag + right`, with
/// `diag = i + seq_k - seq_q` (bottom-right aligned, as the causal mask; with
/// [`CausalAlignment::TopLeft`] the options put it at `diag = i`, see
/// [`FlashAttentionOptions::sees`]). A side that is `None` is unbounded. With causal masking
/// the right side is 0 whatever it says here.
///
/// Mistral's sliding window of `w` tokens (each token sees itself and the `w - 1` before it) is
/// `FlashAttentionOptions::causal().with_sliding_window(w - 1)`.
///
/// # Example
///
/// ```
/// use burn_flash::{AttentionWindow, FlashAttentionOptions};
///
/// // Each query sees the 128 keys before its diagonal, the diagonal and the 16 after it.
/// let options = FlashAttentionOptions::new().with_window(AttentionWindow::new(Some(128), Some(16)));
/// assert_eq!(options.window.unwrap().left, Some(128));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AttentionWindow {
    /// Keys before the diagonal that stay visible; `None`: all of them.
    pub left: Option<usize>,
    /// Keys after the diagonal that stay visible; `None`: all of them.
    pub right: Option<usize>,
}

impl AttentionWindow {
    /// The band `[diag - left, diag + right]`, `None` sides unbounded.
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::AttentionWindow;
    ///
    /// let window = AttentionWindow::new(Some(3), None);
    /// assert!(window.sees(10, 7, 20, 20)); // 3 keys before the diagonal
    /// assert!(!window.sees(10, 6, 20, 20));
    /// assert!(window.sees(10, 19, 20, 20)); // unbounded on the right
    /// ```
    pub fn new(left: Option<usize>, right: Option<usize>) -> Self {
        Self { left, right }
    }

    /// Whether query `query` of `seq_q` sees key `key` of `seq_k` through this band (the causal
    /// mask aside).
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::AttentionWindow;
    ///
    /// // 4 queries over 6 keys: the diagonal of query 0 is key 2.
    /// let window = AttentionWindow::new(Some(1), Some(0));
    /// assert!(window.sees(0, 1, 4, 6) && window.sees(0, 2, 4, 6));
    /// assert!(!window.sees(0, 0, 4, 6) && !window.sees(0, 3, 4, 6));
    /// ```
    pub fn sees(&self, query: usize, key: usize, seq_q: usize, seq_k: usize) -> bool {
        let (diag, key) = (query as i128 + seq_k as i128 - seq_q as i128, key as i128);
        self.left.is_none_or(|left| key >= diag - left as i128)
            && self.right.is_none_or(|right| key <= diag + right as i128)
    }
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
        Self::default().with_causal(true)
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

    /// These options with the diagonal aligned as `alignment` says (see the type's
    /// documentation).
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::{CausalAlignment, FlashAttentionOptions};
    ///
    /// // PyTorch's `is_causal`: query i sees keys 0..=i, whatever the key count.
    /// let options = FlashAttentionOptions::causal().with_causal_alignment(CausalAlignment::TopLeft);
    /// assert!(options.sees(0, 0, 2, 5) && !options.sees(0, 1, 2, 5));
    /// assert!(FlashAttentionOptions::causal().sees(0, 3, 2, 5)); // bottom-right: 3 = 0 + 5 - 2
    /// ```
    pub fn with_causal_alignment(mut self, alignment: CausalAlignment) -> Self {
        self.causal_alignment = alignment;
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

    /// These options with a band of visible keys around each query's diagonal.
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::{AttentionWindow, FlashAttentionOptions};
    ///
    /// let options = FlashAttentionOptions::new().with_window(AttentionWindow::new(Some(64), Some(64)));
    /// assert_eq!(options.window, Some(AttentionWindow::new(Some(64), Some(64))));
    /// ```
    pub fn with_window(mut self, window: AttentionWindow) -> Self {
        self.window = Some(window);
        self
    }

    /// These options with a sliding window: each query sees the `left` keys before its diagonal
    /// and the diagonal (plus, unless causal, every key after it). With
    /// [`causal`](Self::causal), `with_sliding_window(w - 1)` is Mistral's window of `w`.
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::FlashAttentionOptions;
    ///
    /// let options = FlashAttentionOptions::causal().with_sliding_window(4095);
    /// assert_eq!(options.window.unwrap().left, Some(4095));
    /// ```
    pub fn with_sliding_window(self, left: usize) -> Self {
        self.with_window(AttentionWindow::new(Some(left), None))
    }

    /// These options with a softcap: scores `s` (already scaled) become
    /// `softcap · tanh(s / softcap)` (finite and positive, checked when the attention runs).
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::FlashAttentionOptions;
    ///
    /// let options = FlashAttentionOptions::causal().with_softcap(50.0);
    /// assert_eq!(options.softcap, Some(50.0));
    /// ```
    pub fn with_softcap(mut self, softcap: f64) -> Self {
        self.softcap = Some(softcap);
        self
    }

    /// These options with ALiBi's linear biases on or off (see the type's documentation).
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::FlashAttentionOptions;
    ///
    /// let options = FlashAttentionOptions::causal().with_alibi(true);
    /// assert!(options.alibi);
    /// ```
    pub fn with_alibi(mut self, alibi: bool) -> Self {
        self.alibi = alibi;
        self
    }

    /// These options with dropout of probability `prob` (in `[0, 1)`, checked when the attention
    /// runs) drawn from `seed`; see [`AttentionDropout`].
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::FlashAttentionOptions;
    ///
    /// let options = FlashAttentionOptions::new().with_dropout(0.1, 7);
    /// assert_eq!(options.dropout.unwrap().prob, 0.1);
    /// ```
    pub fn with_dropout(mut self, prob: f64, seed: u64) -> Self {
        self.dropout = Some(AttentionDropout { prob, seed });
        self
    }

    /// These options with a deterministic dQ in the fused backward (`true`, the default), or
    /// (`false`) the faster of the deterministic and the atomic one for each shape.
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::FlashAttentionOptions;
    ///
    /// let options = FlashAttentionOptions::causal().with_deterministic(false);
    /// assert!(!options.deterministic);
    /// ```
    pub fn with_deterministic(mut self, deterministic: bool) -> Self {
        self.deterministic = deterministic;
        self
    }

    /// Whether query `query` of `seq_q` sees key `key` of `seq_k` under the causal mask and
    /// the window, with the diagonal where `causal_alignment` puts it.
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::FlashAttentionOptions;
    ///
    /// let options = FlashAttentionOptions::causal().with_sliding_window(2);
    /// let seen: Vec<usize> = (0..8).filter(|&key| options.sees(5, key, 8, 8)).collect();
    /// assert_eq!(seen, [3, 4, 5]);
    /// ```
    pub fn sees(&self, query: usize, key: usize, seq_q: usize, seq_k: usize) -> bool {
        // The alignment as a key count: `sees` of the window and the causal test below put the
        // diagonal at `query + seq_k - seq_q`; top-left moves it to `query`.
        let seq_k = match self.causal_alignment {
            CausalAlignment::BottomRight => seq_k,
            CausalAlignment::TopLeft => seq_q,
        };
        let causal = !self.causal || key + seq_q <= query + seq_k;
        causal && self.window.is_none_or(|w| w.sees(query, key, seq_q, seq_k))
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

/// ALiBi's slopes for `heads` query heads (Press et al., "Train Short, Test Long"): with `n` the
/// largest power of two not above `heads`, head `h < n` has `2^(−8 (h + 1) / n)` and the others
/// take every other slope of `2n` heads, `2^(−4 (2 (h − n) + 1) / n)`. The kernels compute the
/// same in f32 from the head index.
///
/// # Example
///
/// ```
/// use burn_flash::alibi_slopes;
///
/// assert_eq!(alibi_slopes(4), [0.25, 0.0625, 0.015625, 0.00390625]);
/// assert_eq!(alibi_slopes(2)[0], 2f64.powi(-4));
/// ```
pub fn alibi_slopes(heads: usize) -> Vec<f64> {
    if heads == 0 {
        return Vec::new();
    }
    let n = (1usize << heads.ilog2()) as f64;
    (0..heads)
        .map(|h| {
            let h = h as f64;
            if h < n {
                2f64.powf(-8.0 * (h + 1.0) / n)
            } else {
                2f64.powf(-4.0 * (2.0 * (h - n) + 1.0) / n)
            }
        })
        .collect()
}

impl From<FlashAttentionOptions> for burn::tensor::ops::AttentionModuleOptions {
    /// The options of Burn's own attention that it shares: scale, causal and its alignment,
    /// softcap. Burn has no window, ALiBi or dropout option: a window becomes a mask (see
    /// [`FlashAttentionOptions::sees`]), ALiBi a bias ([`alibi_slopes`]).
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
        Self {
            scale: options.scale,
            softcap: options.softcap,
            is_causal: options.causal,
            causal_alignment: options.causal_alignment,
        }
    }
}
