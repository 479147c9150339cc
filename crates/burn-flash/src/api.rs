//! The public functions: validate, decide the path, run it.

use core::fmt;
use std::collections::BTreeSet;
use std::sync::Mutex;

use burn::backend::Dispatch;
use burn::tensor::module::attention_fallback;
use burn::tensor::ops::{AttentionModuleOptions, CausalAlignment};
use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};

use crate::backend::{FlashAttentionBackend, FlashAttentionProblem, ScoreInputs};
use crate::error::FlashAttentionError;
use crate::kernel::{self, TilePath};
use crate::options::FlashAttentionOptions;
use crate::support::{flash_attention_support, takes_warpgroup};

/// The path an attention call takes, as decided by [`flash_attention_plan`].
///
/// # Example
///
/// ```
/// use burn_flash::{FlashAttentionPlan, TilePath};
///
/// let plan = FlashAttentionPlan::Fused(TilePath::TensorCore);
/// assert!(plan.is_fused());
/// assert_eq!(plan.to_string(), "fused kernel (tensor-core tile)");
/// let hopper = FlashAttentionPlan::FusedWarpgroup;
/// assert!(hopper.is_fused());
/// assert_eq!(hopper.to_string(), "fused kernel (Hopper forward on wgmma)");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FlashAttentionPlan {
    /// The fused kernel runs, with this matrix tile.
    Fused(TilePath),
    /// The fused Hopper forward runs, on warpgroup products (`wgmma`): a CUDA build on an SM90
    /// device (H100, H200), 16-bit inputs of head dim 64 or 128, plain or causal attention
    /// (with [`flash_attention_masked`]'s key padding or boolean mask of a row per query too,
    /// and at head dim 128 its additive bias of a row per query over keys in whole 16 bytes;
    /// other masks and biases take the tensor-core tile), with dropout at head dim 128 and at 64
    /// over more than 2048 keys, each query block walking 1024 keys or more (half the keys when
    /// causal), where it leads the tensor-core tile (`BURN_FLASH_WARPGROUP=0|1` overrides the
    /// rule). Under autodiff the backward runs on the tensor-core tile.
    FusedWarpgroup,
    /// The fused kernel runs with this tile on inputs whose head dims it is not built for,
    /// zero-padded to `head_dim` (queries and keys) and `value_dim` (values): the scores and
    /// the output's first columns are unchanged, the extra columns are dropped, and under
    /// autodiff the gradients are those of the unpadded inputs. It costs a copy of the inputs
    /// and the padded columns' work (head dim 80 runs as 96; 160 and 192 as 256).
    FusedPadded {
        /// The matrix tile.
        tile: TilePath,
        /// The head dim queries and keys are padded to.
        head_dim: usize,
        /// The head dim values are padded to.
        value_dim: usize,
    },
    /// The fused kernel cannot run these inputs (the reason says why); Burn's unfused
    /// `burn::tensor::module::attention_fallback` runs instead, and the reason is logged once
    /// with `log::warn!`.
    Fallback(String),
    /// Nothing is launched: the output has no elements, or there are no keys (`seq_k == 0`),
    /// in which case every query row sees no key and its output is 0.
    Zeros,
}

impl FlashAttentionPlan {
    /// Whether the fused kernel runs.
    ///
    /// # Example
    ///
    /// ```
    /// use burn_flash::FlashAttentionPlan;
    ///
    /// assert!(!FlashAttentionPlan::Fallback("head dim 72".into()).is_fused());
    /// ```
    pub fn is_fused(&self) -> bool {
        matches!(
            self,
            Self::Fused(_) | Self::FusedWarpgroup | Self::FusedPadded { .. }
        )
    }
}

impl fmt::Display for FlashAttentionPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Fused(TilePath::TensorCore) => write!(f, "fused kernel (tensor-core tile)"),
            Self::Fused(TilePath::Portable) => write!(f, "fused kernel (portable tile)"),
            Self::FusedWarpgroup => write!(f, "fused kernel (Hopper forward on wgmma)"),
            Self::FusedPadded {
                tile,
                head_dim,
                value_dim,
            } => {
                let tile = match tile {
                    TilePath::TensorCore => "tensor-core",
                    TilePath::Portable => "portable",
                };
                write!(
                    f,
                    "fused kernel ({tile} tile, head dims zero-padded to {head_dim}/{value_dim})"
                )
            }
            Self::Fallback(reason) => write!(f, "unfused fallback ({reason})"),
            Self::Zeros => write!(f, "no launch (the output is zeros or empty)"),
        }
    }
}

/// Which path [`flash_attention`] would take for these inputs, without running anything; or
/// the error [`try_flash_attention`] would return. The Hopper forward
/// ([`FlashAttentionPlan::FusedWarpgroup`]) is reported for inputs whose rows are 16-byte
/// aligned, as contiguous ones are (a view that is not is read by the tensor-core tile).
///
/// # Example
///
/// ```
/// use burn::tensor::Tensor;
/// use burn_flash::{flash_attention_plan, FlashAttentionOptions};
///
/// fn report(q: &Tensor<4>, k: &Tensor<4>, v: &Tensor<4>) {
///     match flash_attention_plan(q, k, v, FlashAttentionOptions::causal()) {
///         Ok(plan) => println!("attention runs as: {plan}"),
///         Err(error) => println!("attention refused: {error}"),
///     }
/// }
/// ```
pub fn flash_attention_plan(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    options: FlashAttentionOptions,
) -> Result<FlashAttentionPlan, FlashAttentionError> {
    let plan = plan(q, k, v, options)?;
    Ok(match plan.route {
        FlashAttentionPlan::Fused(TilePath::TensorCore)
            if takes_warpgroup(q.device().as_dispatch(), &plan.problem, &options) =>
        {
            FlashAttentionPlan::FusedWarpgroup
        }
        route => route,
    })
}

/// Fused attention, `softmax(scale · Q·Kᵀ [+ mask]) · V`, on `[batch, heads, seq, head_dim]`
/// tensors: `q: [b, h, seq_q, d]`, `k: [b, hkv, seq_k, d]`, `v: [b, hkv, seq_k, dv]`, output
/// `[b, h, seq_q, dv]` in the inputs' dtype. `h` is a multiple of `hkv`: query head `i` reads
/// key/value head `i / (h / hkv)` (grouped-query attention; `hkv == h` is plain multi-head
/// attention), without copying K and V. The conventions are those of
/// `burn::tensor::module::attention`; the causal mask, the sliding window and the softcap are
/// options (see [`FlashAttentionOptions`]).
///
/// - Runs the fused kernel when the backend supports the inputs; otherwise Burn's unfused
///   `attention_fallback`, logging the reason once per distinct reason (`log::warn!`).
///   [`flash_attention_plan`] says beforehand which one runs.
/// - `seq_k == 0`: the output is zeros (no row sees a key); an output with no elements is
///   returned as is. Nothing is launched in these cases.
/// - `head_dim == 0`: every score is 0, so each row averages the values it sees.
///
/// # Panics
///
/// On the inputs [`try_flash_attention`] refuses, with the [`FlashAttentionError`]'s message.
///
/// # Example
///
/// ```no_run
/// use burn::tensor::{Device, Distribution, Tensor};
/// use burn_flash::{flash_attention, FlashAttentionOptions};
///
/// let device = Device::wgpu(Default::default());
/// let q = Tensor::<4>::random([2, 8, 128, 64], Distribution::Normal(0.0, 1.0), &device);
/// let k = Tensor::<4>::random([2, 8, 128, 64], Distribution::Normal(0.0, 1.0), &device);
/// let v = Tensor::<4>::random([2, 8, 128, 64], Distribution::Normal(0.0, 1.0), &device);
/// let out = flash_attention(q, k, v, FlashAttentionOptions::causal());
/// assert_eq!(out.dims(), [2, 8, 128, 64]);
/// ```
#[track_caller]
pub fn flash_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    options: FlashAttentionOptions,
) -> Tensor<4> {
    flash_attention_masked(q, k, v, None, None, options)
}

/// [`flash_attention`], returning an error instead of panicking on invalid inputs: batch sizes
/// that differ between `q`, `k` and `v`, key/value heads that differ or do not divide the query
/// heads, head dims of `q` and `k` that differ, sequence lengths of `k` and `v` that differ,
/// different devices or dtypes, a dtype other than f16, bf16 and f32, a scale or softcap that is
/// not finite and positive. [`try_flash_attention_masked`] also takes a mask and a bias.
///
/// # Example
///
/// ```
/// use burn::tensor::Tensor;
/// use burn_flash::{try_flash_attention, FlashAttentionError, FlashAttentionOptions};
///
/// fn attend(
///     q: Tensor<4>,
///     k: Tensor<4>,
///     v: Tensor<4>,
/// ) -> Result<Tensor<4>, FlashAttentionError> {
///     try_flash_attention(q, k, v, FlashAttentionOptions::new().with_scale(0.1))
/// }
/// ```
pub fn try_flash_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    options: FlashAttentionOptions,
) -> Result<Tensor<4>, FlashAttentionError> {
    try_flash_attention_masked(q, k, v, None, None, options)
}

/// The fused forward's output and the log-sum-exp of each query row, `[batch, heads, seq_q]` in
/// f32: the natural log of `Σ_j exp(scale · q_i·k_j)` over the keys the row sees, `-inf` for a
/// row that sees none. What the fused backward recomputes the probabilities from; useful to
/// combine partial attentions (split keys, ring attention) by their log-sum-exp.
///
/// # Panics
///
/// On the inputs [`try_flash_attention`] refuses, and where the fused kernel does not run them
/// (when [`flash_attention_plan`] is not [`FlashAttentionPlan::Fused`]).
///
/// # Example
///
/// ```no_run
/// use burn::tensor::{Device, Distribution, Tensor};
/// use burn_flash::{flash_attention_with_lse, FlashAttentionOptions};
///
/// let device = Device::wgpu(Default::default());
/// let [q, k, v] = [0, 1, 2]
///     .map(|_| Tensor::<4>::random([1, 4, 64, 32], Distribution::Normal(0.0, 1.0), &device));
/// let (out, lse) = flash_attention_with_lse(q, k, v, FlashAttentionOptions::causal());
/// assert_eq!(lse.dims(), [1, 4, 64]);
/// ```
#[track_caller]
pub fn flash_attention_with_lse(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    options: FlashAttentionOptions,
) -> (Tensor<4>, Tensor<3>) {
    let (plan, _, options) = match checked(&q, &k, &v, None, None, options) {
        Ok(checked) => checked,
        Err(error) => panic!("{error}"),
    };
    assert!(
        plan.route.is_fused(),
        "flash_attention_with_lse: the fused kernel does not run these inputs: {}",
        plan.route
    );
    fused(q, k, v, ScoreInputs::Neither, options, &plan.route)
}

/// Which (query, key) pairs a boolean mask hides: `true` hides the pair, as in Burn's
/// `attention` and `generate_padding_mask`. A query row that sees no key gets an output of 0
/// (and zero gradients), not NaN.
///
/// # Example
///
/// ```
/// use burn::tensor::{Bool, Device, Tensor, TensorData};
/// use burn_flash::AttentionMask;
///
/// // Sequences of these lengths padded to `seq_k` keys: the keys past each length are padding.
/// fn padding(
///     lengths: &[usize],
///     seq_k: usize,
///     device: &Device,
/// ) -> AttentionMask {
///     let hidden: Vec<bool> = lengths
///         .iter()
///         .flat_map(|&len| (0..seq_k).map(move |key| key >= len))
///         .collect();
///     let data = TensorData::new(hidden, [lengths.len(), seq_k]);
///     AttentionMask::KeyPadding(Tensor::<2, Bool>::from_data(data, device))
/// }
/// ```
#[derive(Clone, Debug)]
pub enum AttentionMask {
    /// `[batch, seq_k]`: `true` marks the keys (padding) that no query of that sequence sees.
    KeyPadding(Tensor<2, Bool>),
    /// `[batch|1, heads|1, seq_q|1, seq_k]`: `true` hides the pair; a dim of 1 broadcasts (the
    /// same mask for every batch, head or query). Burn's full `[batch, heads, seq_q, seq_k]` mask
    /// is the unbroadcast case.
    Full(Tensor<4, Bool>),
}

/// [`flash_attention`] with a boolean mask and an additive bias, as Burn's
/// `burn::tensor::module::attention(q, k, v, mask, bias, options)`: the scores are
/// `softcap(scale · Q·Kᵀ) + bias`, pairs the mask hides (or the causal mask, or the window) are
/// dropped, and the rest goes through the softmax. `bias` is
/// `[batch|1, heads|1, seq_q|1, seq_k]` in the inputs' dtype, a dim of 1 broadcasting (ALiBi,
/// relative-position biases); its gradient is computed when it requires one (under
/// `Autodiff`, at the cost of writing a `[batch, heads, seq_q, seq_k]` gradient before summing
/// it to the bias's shape).
///
/// Both run inside the fused kernels, forward and backward: nothing of size
/// `seq_q × seq_k` is built from them. A bias of `-inf` hides a pair like the mask.
///
/// # Panics
///
/// On the inputs [`try_flash_attention_masked`] refuses, with the [`FlashAttentionError`]'s
/// message.
///
/// # Example
///
/// ```no_run
/// use burn::tensor::{Bool, Device, Distribution, Int, Tensor};
/// use burn_flash::{flash_attention_masked, AttentionMask, FlashAttentionOptions};
///
/// let device = Device::wgpu(Default::default());
/// let [b, h, n, d] = [2, 8, 128, 64];
/// let q = Tensor::<4>::random([b, h, n, d], Distribution::Normal(0.0, 1.0), &device);
/// let k = Tensor::<4>::random([b, h, n, d], Distribution::Normal(0.0, 1.0), &device);
/// let v = Tensor::<4>::random([b, h, n, d], Distribution::Normal(0.0, 1.0), &device);
/// // The last 28 keys of every sequence are padding; one bias per head and pair.
/// let padding = Tensor::<1, Int>::arange(0..n as i64, &device)
///     .greater_equal_elem(100)
///     .unsqueeze::<2>()
///     .repeat_dim(0, b);
/// let bias = Tensor::<4>::random([1, h, n, n], Distribution::Normal(0.0, 1.0), &device);
/// let out = flash_attention_masked(
///     q,
///     k,
///     v,
///     Some(AttentionMask::KeyPadding(padding)),
///     Some(bias),
///     FlashAttentionOptions::new(),
/// );
/// assert_eq!(out.dims(), [b, h, n, d]);
/// ```
#[track_caller]
pub fn flash_attention_masked(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<AttentionMask>,
    bias: Option<Tensor<4>>,
    options: FlashAttentionOptions,
) -> Tensor<4> {
    match try_flash_attention_masked(q, k, v, mask, bias, options) {
        Ok(output) => output,
        Err(error) => panic!("{error}"),
    }
}

/// [`flash_attention_masked`], returning an error instead of panicking on invalid inputs: those
/// [`try_flash_attention`] refuses, and a mask or bias of the wrong shape, a bias of another
/// dtype than `q`, a mask or bias on another device.
///
/// # Example
///
/// ```
/// use burn::tensor::{Bool, Tensor};
/// use burn_flash::{
///     try_flash_attention_masked, AttentionMask, FlashAttentionError,
///     FlashAttentionOptions,
/// };
///
/// fn padded(
///     x: Tensor<4>,
///     padding: Tensor<2, Bool>,
/// ) -> Result<Tensor<4>, FlashAttentionError> {
///     let mask = Some(AttentionMask::KeyPadding(padding));
///     try_flash_attention_masked(x.clone(), x.clone(), x, mask, None, FlashAttentionOptions::new())
/// }
/// ```
pub fn try_flash_attention_masked(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<AttentionMask>,
    bias: Option<Tensor<4>>,
    options: FlashAttentionOptions,
) -> Result<Tensor<4>, FlashAttentionError> {
    let (
        Plan {
            problem: p, route, ..
        },
        mask,
        options,
    ) = checked(&q, &k, &v, mask, bias.as_ref(), options)?;
    let device = q.device();
    if route == FlashAttentionPlan::Zeros {
        let shape = [p.batch, p.heads, p.seq_q, p.value_dim];
        return Ok(Tensor::zeros(shape, (&device, p.dtype)));
    }
    let (q, k) = if q.dims()[3] == 0 {
        // No features: every score is 0. One zero feature gives the same scores.
        (
            Tensor::zeros([p.batch, p.heads, p.seq_q, 1], (&device, p.dtype)),
            Tensor::zeros([p.batch, p.kv_heads, p.seq_k, 1], (&device, p.dtype)),
        )
    } else {
        (q, k)
    };

    Ok(match route {
        FlashAttentionPlan::Fused(_)
        | FlashAttentionPlan::FusedWarpgroup
        | FlashAttentionPlan::FusedPadded { .. } => {
            let inputs = ScoreInputs::new(
                mask.map(Tensor::into_dispatch),
                bias.map(Tensor::into_dispatch),
            );
            fused(q, k, v, inputs, options, &route).0
        }
        FlashAttentionPlan::Fallback(reason) => {
            warn_once(&reason);
            fallback(q, k, v, mask, bias, options, attention_fallback)
        }
        FlashAttentionPlan::Zeros => unreachable!("returned above"),
    })
}

/// The fused forward's output and log-sum-exp, on head dims zero-padded where `route` says
/// (the output's padded columns dropped).
fn fused(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    inputs: ScoreInputs<Dispatch>,
    options: FlashAttentionOptions,
    route: &FlashAttentionPlan,
) -> (Tensor<4>, Tensor<3>) {
    let value_dim = v.dims()[3];
    let (q, k, v) = padded_to(route, q, k, v);
    let forward = <Dispatch as FlashAttentionBackend>::flash_attention_forward(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        inputs,
        options,
    );
    let output = Tensor::<4>::from_dispatch(forward.output);
    let output = if output.dims()[3] == value_dim {
        output
    } else {
        output.narrow(3, 0, value_dim)
    };
    (output, Tensor::from_dispatch(forward.lse))
}

/// `q`, `k` and `v` with zero columns up to the head dims `route` pads them to, if it does.
pub(crate) fn padded_to(
    route: &FlashAttentionPlan,
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    match *route {
        FlashAttentionPlan::FusedPadded {
            head_dim,
            value_dim,
            ..
        } => (
            pad_columns(q, head_dim),
            pad_columns(k, head_dim),
            pad_columns(v, value_dim),
        ),
        _ => (q, k, v),
    }
}

/// `x` with zero columns appended up to `dim`.
fn pad_columns(x: Tensor<4>, dim: usize) -> Tensor<4> {
    let [batch, heads, seq, columns] = x.dims();
    if columns == dim {
        return x;
    }
    let zeros = Tensor::zeros([batch, heads, seq, dim - columns], (&x.device(), x.dtype()));
    Tensor::cat(vec![x, zeros], 3)
}

/// The mask as the kernels take it, `[batch|1, heads|1, seq_q|1, seq_k]`, once its shape and
/// device are checked.
fn validate_mask(
    mask: AttentionMask,
    p: &FlashAttentionProblem,
    device: &Device,
) -> Result<Tensor<4, Bool>, FlashAttentionError> {
    let mask_device = match &mask {
        AttentionMask::KeyPadding(mask) => mask.device(),
        AttentionMask::Full(mask) => mask.device(),
    };
    if &mask_device != device {
        return Err(FlashAttentionError::InputDevice {
            input: "mask",
            expected: format!("{device:?}"),
            got: format!("{mask_device:?}"),
        });
    }
    match mask {
        AttentionMask::KeyPadding(mask) => {
            let [batch, seq_k] = mask.dims();
            if !broadcasts(batch, p.batch) || seq_k != p.seq_k {
                return Err(FlashAttentionError::MaskShape {
                    expected: format!("[{}|1, {}] (key padding)", p.batch, p.seq_k),
                    got: vec![batch, seq_k],
                });
            }
            Ok(mask.reshape([batch, 1, 1, seq_k]))
        }
        AttentionMask::Full(mask) => {
            let dims = mask.dims();
            if !fits_scores(dims, p) {
                return Err(FlashAttentionError::MaskShape {
                    expected: scores_shape(p),
                    got: dims.to_vec(),
                });
            }
            Ok(mask)
        }
    }
}

/// Check the bias's shape, dtype and device.
fn validate_bias(
    bias: &Tensor<4>,
    p: &FlashAttentionProblem,
    device: &Device,
) -> Result<(), FlashAttentionError> {
    let bias_device = bias.device();
    if &bias_device != device {
        return Err(FlashAttentionError::InputDevice {
            input: "bias",
            expected: format!("{device:?}"),
            got: format!("{bias_device:?}"),
        });
    }
    if bias.dtype() != p.dtype {
        return Err(FlashAttentionError::BiasDType {
            expected: p.dtype,
            got: bias.dtype(),
        });
    }
    if !fits_scores(bias.dims(), p) {
        return Err(FlashAttentionError::BiasShape {
            expected: scores_shape(p),
            got: bias.dims().to_vec(),
        });
    }
    Ok(())
}

/// Whether a dim of `size` broadcasts to `full` (equal, or 1).
fn broadcasts(size: usize, full: usize) -> bool {
    size == full || size == 1
}

/// Whether `dims` is `[batch|1, heads|1, seq_q|1, seq_k]`.
fn fits_scores(dims: [usize; 4], p: &FlashAttentionProblem) -> bool {
    broadcasts(dims[0], p.batch)
        && broadcasts(dims[1], p.heads)
        && broadcasts(dims[2], p.seq_q)
        && dims[3] == p.seq_k
}

fn scores_shape(p: &FlashAttentionProblem) -> String {
    format!("[{}|1, {}|1, {}|1, {}]", p.batch, p.heads, p.seq_q, p.seq_k)
}

/// Burn's unfused attention with the same semantics: key/value heads repeated for their query
/// heads, the window joined to the mask, mask and bias broadcast to the scores' shape.
///
/// With a bias, every hidden pair (the mask's, the window's, the causal mask's and the bias's
/// own `-inf`) is joined into one mask and the bias is zeroed there: Burn's unfused backward
/// otherwise multiplies an overflowed gradient by the 0 probability of a row that sees no key
/// and returns NaN for the bias there, where the gradient is 0.
fn fallback(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<4, Bool>>,
    bias: Option<Tensor<4>>,
    mut options: FlashAttentionOptions,
    op: impl BurnAttention,
) -> Tensor<4> {
    let ([batch, heads, seq_q, _], [_, kv_heads, seq_k, _]) = (q.dims(), k.dims());
    let expand = |t: Tensor<4>| {
        if kv_heads == heads {
            return t;
        }
        let [_, _, seq, dim] = t.dims();
        t.unsqueeze_dim::<5>(2)
            .expand([batch, kv_heads, heads / kv_heads, seq, dim])
            .reshape([batch, heads, seq, dim])
    };
    let scores = [batch, heads, seq_q, seq_k];
    let bias = if options.alibi {
        let shift = match options.causal_alignment {
            CausalAlignment::BottomRight => seq_k as f64 - seq_q as f64,
            CausalAlignment::TopLeft => 0.0,
        };
        let alibi = alibi_bias(heads, seq_q, seq_k, shift, q.dtype(), &q.device()).expand(scores);
        Some(bias.map_or(alibi.clone(), |bias| bias.expand(scores) + alibi))
    } else {
        bias
    };
    // With a bias the causal mask joins the band, so that the bias can be zeroed on it too.
    let biased = bias.is_some();
    let band = (options.window.is_some() || (options.causal && biased)).then(|| {
        let hidden: Vec<bool> = (0..seq_q * seq_k)
            .map(|at| !options.sees(at / seq_k, at % seq_k, seq_q, seq_k))
            .collect();
        Tensor::<2, Bool>::from_data(TensorData::new(hidden, [seq_q, seq_k]), &q.device())
            .unsqueeze::<4>()
            .expand(scores)
    });
    options.causal &= !biased;
    let join = |a: Option<Tensor<4, Bool>>, b: Tensor<4, Bool>| match a {
        Some(a) => a.bool_or(b),
        None => b,
    };
    let mask = match band {
        Some(band) => Some(join(mask.map(|mask| mask.expand(scores)), band)),
        None => mask.map(|mask| mask.expand(scores)),
    };
    let (mask, bias) = match bias {
        Some(bias) => {
            let bias = bias.expand(scores);
            let hidden = join(mask, bias.clone().equal_elem(f32::NEG_INFINITY));
            (Some(hidden.clone()), Some(bias.mask_fill(hidden, 0.0)))
        }
        None => (mask, None),
    };
    op(q, expand(k), expand(v), mask, bias, options.into())
}

/// ALiBi's bias `[1, heads, seq_q, seq_k]`, `−slope_h · |j − (i + shift)|` (the diagonal of query
/// `i` is key `i + shift`), in `dtype`, formed on the device from the slopes and the key and
/// diagonal positions.
fn alibi_bias(
    heads: usize,
    seq_q: usize,
    seq_k: usize,
    shift: f64,
    dtype: DType,
    device: &Device,
) -> Tensor<4> {
    let slopes: Vec<f32> = crate::options::alibi_slopes(heads)
        .into_iter()
        .map(|slope| -slope as f32)
        .collect();
    let slopes = Tensor::<1>::from_data(TensorData::new(slopes, [heads]), (device, DType::F32));
    let keys = Tensor::<1, Int>::arange(0..seq_k as i64, device).float();
    let diagonals = Tensor::<1, Int>::arange(0..seq_q as i64, device)
        .float()
        .add_scalar(shift);
    let distance = (keys.unsqueeze::<2>() - diagonals.unsqueeze_dim::<2>(1)).abs();
    (slopes.reshape([1, heads, 1, 1]) * distance.unsqueeze::<4>()).cast(dtype)
}

/// An attention function with the signature of Burn's `module::attention` and
/// `module::attention_fallback`.
pub(crate) trait BurnAttention:
    FnOnce(
    Tensor<4>,
    Tensor<4>,
    Tensor<4>,
    Option<Tensor<4, Bool>>,
    Option<Tensor<4>>,
    AttentionModuleOptions,
) -> Tensor<4>
{
}

impl<F> BurnAttention for F where
    F: FnOnce(
        Tensor<4>,
        Tensor<4>,
        Tensor<4>,
        Option<Tensor<4, Bool>>,
        Option<Tensor<4>>,
        AttentionModuleOptions,
    ) -> Tensor<4>
{
}

/// The function [`flash_attention_masked`] computes, by one of Burn's attention functions
/// (`op`) given the same inputs and options as the fused kernel (the window and grouped heads
/// expanded for it): the other kernels of [`nn`](crate::nn).
///
/// # Panics
///
/// On the inputs [`try_flash_attention_masked`] refuses.
#[track_caller]
pub(crate) fn burn_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<AttentionMask>,
    bias: Option<Tensor<4>>,
    options: FlashAttentionOptions,
    op: impl BurnAttention,
) -> Tensor<4> {
    match checked(&q, &k, &v, mask, bias.as_ref(), options) {
        Ok((_, mask, options)) => fallback(q, k, v, mask, bias, options, op),
        Err(error) => panic!("{error}"),
    }
}

/// A call's plan once every input is checked, the mask as the kernels take it, and the options
/// with the resolved scale.
#[allow(clippy::type_complexity)]
fn checked(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    mask: Option<AttentionMask>,
    bias: Option<&Tensor<4>>,
    options: FlashAttentionOptions,
) -> Result<(Plan, Option<Tensor<4, Bool>>, FlashAttentionOptions), FlashAttentionError> {
    let plan = plan(q, k, v, options)?;
    let device = q.device();
    let mask = mask
        .map(|mask| validate_mask(mask, &plan.problem, &device))
        .transpose()?;
    if let Some(bias) = bias {
        validate_bias(bias, &plan.problem, &device)?;
    }
    let options = options.with_scale(plan.scale);
    Ok((plan, mask, options))
}

/// A validated call: the problem the backend sees, the resolved scale and the path.
pub(crate) struct Plan {
    pub(crate) problem: FlashAttentionProblem,
    pub(crate) scale: f64,
    pub(crate) route: FlashAttentionPlan,
}

pub(crate) fn plan(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    options: FlashAttentionOptions,
) -> Result<Plan, FlashAttentionError> {
    let dtype = validate(q, k, v)?;
    let problem = FlashAttentionProblem::new(q.dims(), k.dims(), v.dims(), dtype, options.causal);
    plan_problem(problem, options, &q.device())
}

/// The plan of a validated problem on `device`: the options checked, the scale resolved, the
/// path decided.
pub(crate) fn plan_problem(
    mut problem: FlashAttentionProblem,
    options: FlashAttentionOptions,
    device: &Device,
) -> Result<Plan, FlashAttentionError> {
    if options.scale.is_some_and(|scale| !positive_f32(scale)) {
        return Err(FlashAttentionError::InvalidScale(
            options.scale.unwrap_or_default(),
        ));
    }
    if options.softcap.is_some_and(|cap| !positive_f32(cap)) {
        return Err(FlashAttentionError::InvalidSoftcap(
            options.softcap.unwrap_or_default(),
        ));
    }
    if let Some(dropout) = options.dropout
        && !(dropout.prob.is_finite() && (0.0..1.0).contains(&dropout.prob))
    {
        return Err(FlashAttentionError::InvalidDropout(dropout.prob));
    }
    let mut scale = options.scale_for(problem.head_dim);

    let output_len = problem.batch * problem.heads * problem.seq_q * problem.value_dim;
    if output_len == 0 || problem.seq_k == 0 {
        return Ok(Plan {
            problem,
            scale,
            route: FlashAttentionPlan::Zeros,
        });
    }
    if problem.head_dim == 0 {
        // Run with one zero feature instead (see `try_flash_attention`); any scale will do.
        problem.head_dim = 1;
        scale = 1.0;
    }

    let forced_padding = crate::testing::head_dims_padded();
    let route = match flash_attention_support(device, &problem) {
        Ok(tile) if !forced_padding => FlashAttentionPlan::Fused(tile),
        supported => match padded(device, &problem, forced_padding) {
            Some(route) => route,
            None => match supported {
                Ok(tile) => FlashAttentionPlan::Fused(tile),
                Err(reason) if options.dropout.is_some_and(|d| d.is_active()) => {
                    return Err(FlashAttentionError::DropoutUnsupported(reason));
                }
                Err(reason) => FlashAttentionPlan::Fallback(reason),
            },
        },
    };
    Ok(Plan {
        problem,
        scale,
        route,
    })
}

/// The padded route of a problem whose head dims the tensor-core tile is not built for: the
/// smallest dims of the tile that hold them, where the tensor-core tile runs those (on any tile
/// while a [`pad_head_dims`](crate::testing::pad_head_dims) guard lives, `forced`).
fn padded(
    device: &Device,
    problem: &FlashAttentionProblem,
    forced: bool,
) -> Option<FlashAttentionPlan> {
    let head_dim = kernel::tensor_core_dim(problem.head_dim)?;
    let value_dim = kernel::tensor_core_dim(problem.value_dim)?;
    if (head_dim, value_dim) == (problem.head_dim, problem.value_dim) {
        return None;
    }
    let padded = FlashAttentionProblem {
        head_dim,
        value_dim,
        ..*problem
    };
    let tile = flash_attention_support(device, &padded).ok()?;
    (forced || tile == TilePath::TensorCore).then_some(FlashAttentionPlan::FusedPadded {
        tile,
        head_dim,
        value_dim,
    })
}

/// Whether `value` is finite and positive, also once rounded to the kernels' f32.
fn positive_f32(value: f64) -> bool {
    let single = value as f32;
    value.is_finite() && value > 0.0 && single.is_finite() && single > 0.0
}

/// The checks the type system leaves: dtypes, devices, shapes. Returns the common dtype.
fn validate(q: &Tensor<4>, k: &Tensor<4>, v: &Tensor<4>) -> Result<DType, FlashAttentionError> {
    let dtype = validate_types(q, k, v)?;
    let ([qb, qh, _, qdim], [kb, kh, ks, kdim], [vb, vh, vs, _]) = (q.dims(), k.dims(), v.dims());
    if qb != kb || qb != vb {
        return Err(FlashAttentionError::BatchMismatch {
            q: qb,
            k: kb,
            v: vb,
        });
    }
    validate_heads(qh, kh, vh, qdim, kdim)?;
    if ks != vs {
        return Err(FlashAttentionError::KeyValueLengthMismatch { k: ks, v: vs });
    }
    Ok(dtype)
}

/// Query heads a multiple of the key/value heads (grouped-query attention: each serves
/// `q / kv` of them), `k` and `v` with as many, `q` and `k` with the same head dim.
pub(crate) fn validate_heads(
    q: usize,
    k: usize,
    v: usize,
    q_dim: usize,
    k_dim: usize,
) -> Result<(), FlashAttentionError> {
    if k != v || (k == 0 && q != 0) || (k != 0 && !q.is_multiple_of(k)) {
        return Err(FlashAttentionError::HeadsMismatch { q, k, v });
    }
    if q_dim != k_dim {
        return Err(FlashAttentionError::HeadDimMismatch { q: q_dim, k: k_dim });
    }
    Ok(())
}

/// One dtype of the three, f16, bf16 or f32, and one device. Returns the dtype.
pub(crate) fn validate_types(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
) -> Result<DType, FlashAttentionError> {
    let (qt, kt, vt) = (q.dtype(), k.dtype(), v.dtype());
    if qt != kt || qt != vt {
        return Err(FlashAttentionError::DTypeMismatch {
            q: qt,
            k: kt,
            v: vt,
        });
    }
    if !matches!(qt, DType::F16 | DType::BF16 | DType::F32) {
        return Err(FlashAttentionError::UnsupportedDType(qt));
    }

    let (qd, kd, vd) = (q.device(), k.device(), v.device());
    if qd != kd || qd != vd {
        return Err(FlashAttentionError::DeviceMismatch {
            q: format!("{qd:?}"),
            k: format!("{kd:?}"),
            v: format!("{vd:?}"),
        });
    }

    Ok(qt)
}

/// Log why the fused kernel did not run, once per distinct reason.
fn warn_once(reason: &str) {
    static WARNED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    let mut warned = WARNED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if !warned.contains(reason) {
        log::warn!(
            "burn-flash: the fused attention kernel cannot run these inputs ({reason}); \
             using Burn's unfused attention_fallback instead"
        );
        warned.insert(reason.to_owned());
    }
}

#[cfg(test)]
mod tests;
