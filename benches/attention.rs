//! Attention timings: `burn-flash` (this crate's fused op) against Burn's own
//! `attention_fallback` (`burn-unfused`) and `attention` (`burn-builtin`), forward (`fwd`) and
//! forward + backward on the autodiff device (`fwdbwd`: one call, then `backward()` of its
//! output), as CSV on stdout with the columns of `../../shared/tools/torch_sdpa_bench.py`, so
//! both tables can be joined:
//!
//! ```text
//! impl,dtype,b,h,hkv,n,d,causal,mode,ms,tflops
//! ```
//!
//! On CUDA (built with `--features cuda` and a device present) it runs bf16 on the
//! FlashAttention-2 shapes: 16k tokens (`b = 16384 / n`), hidden 2048 (`h = 2048 / d`),
//! `n` 512..16384, `d` 64 and 128, causal and not. Elsewhere it runs f32 on
//! `Device::wgpu` with small shapes (it may be lavapipe, a CPU).
//!
//! ```text
//! cargo bench --features cuda --bench attention -- --d 64,128 --n 1024,4096 --causal both
//! cargo bench --features cuda --bench attention -- --modes fwd,fwdbwd --hkv 4 --mask keypad
//! cargo bench --bench attention -- --help
//! ```
//!
//! Every flag is listed by `--help`; lists are comma-separated (`--n 1024,4096`). The peers are
//! Burn 0.23's functions on the same `Device` (its fusion stream included):
//!
//! - `burn-unfused` is `burn::tensor::module::attention_fallback`, the attention composed of
//!   tensor operations (scores, softmax, product), differentiated op by op under autodiff.
//! - `burn-builtin` is `burn::tensor::module::attention`, the backend's own: on CubeCL a flash
//!   kernel where its options allow, else `attention_fallback`. Under autodiff, without a mask or
//!   bias, it records one node whose backward is the backend's fused `attention_backward`; with
//!   a mask or a bias autodiff differentiates `attention_fallback` instead.
//!
//! Both take grouped-query inputs from their shapes (query head `i` reads key/value head
//! `i / (h / hkv)`), so with `--hkv` they get `k` and `v` with their `hkv` heads as burn-flash
//! does, not expanded copies. Masks and biases are expanded (a view) to the `[b, h, n, n]` their
//! contract names. The causal mask is aligned bottom-right (`CausalAlignment::BottomRight`,
//! Burn's default and burn-flash's); with `seq_q == seq_k`, as here, both alignments agree.
//!
//! Method: a first call (compilation, autotune) and `--warmup` more calls are not timed; then
//! `--iters` samples, each a batch of calls issued back to back between two device
//! synchronisations (`Device::sync`; as many calls as fill about 20 ms, at most 50), rotating
//! between `--sets` independent input sets so no call finds its inputs in cache; the median of
//! the samples' per-call times is reported. The host prepares the next call while the device
//! runs this one, so a synchronisation per call is not charged to the kernels; stderr gives the
//! host's time to issue one call per row (the device is starved when it nears the call's time).
//!
//! `--timing` says what runs between two calls. `b2b` (the default) issues the calls back to
//! back, so that a kernel that runs at the card's power cap stays there for the whole batch.
//! `clear` is what PyTorch's `do_bench`, the torch script's timer, does: a pass over a buffer
//! larger than the L2 cache before every call (do_bench zeroes 256 MB; here a 128 MiB buffer is
//! reversed, which moves the same 256 MiB). The calls are then timed by difference: each sample
//! times a batch of clears alone, then a batch of clears each followed by a call, and reports
//! the difference per call; stderr gives the time of one clear, which should be that of 256 MiB
//! at the device's bandwidth (a clear merged into another would show as a shorter one). The
//! summary's peak memory then includes the clear's buffer and its reversal (256 MiB).
//!
//! TFLOPS counts `4·b·h·n²·d`, halved when causal, times 3.5 for `fwdbwd`. A call slower than
//! `--budget-ms` skips the row with a `#` comment line, and so do the longer lengths of that
//! implementation (also when the last length's time, scaled by the FLOPs, predicts a call over
//! the budget: a first call, with its autotune, cannot be interrupted); a call that fails prints
//! its row with `nan` times and the error as a comment.
//!
//! After the CSV comes a summary as `#` lines (CSV readers skip them): per shape, burn-flash's
//! time and the device memory the pools held after its row (`Device::memory_pool_usage`'s
//! `bytes_reserved`: the row's high-water mark at page granularity, inputs included; pages of
//! earlier rows are released by `Device::memory_cleanup` before each row), and its speed-up over
//! each peer that ran the shape, with the geometric mean per mode and peer. Rows of another
//! program on the same device, e.g. `torch_sdpa_bench.py`'s CSV, join the summary with
//! `--peers FILE`.
//!
//! `--memory` instead runs one training step (forward + backward of `--impls`' first
//! implementation) per length and prints what `Device::memory_pool_usage` reports afterwards
//! (on CUDA, and on wgpu too): the device memory the pools hold (`bytes_reserved`, the
//! high-water mark of the step: pools keep their pages) and what is still allocated
//! (`bytes_in_use`). Run one length per process for clean figures.
//!
//! Burn 0.21's `--backend cuda-bare` (Burn's CUDA backend without the fusion stream, to see
//! what the stream costs per call) is gone: Burn 0.23's tensors run on the runtime-dispatched
//! `Device`, whose CUDA device has the fusion stream whenever Burn's `fusion` feature is on, as
//! it is in this workspace; there is no bare backend to pick at run time.

mod common;

use std::collections::HashMap;
use std::fmt::Display;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use burn::tensor::module::{attention, attention_fallback};
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, DType, Device, Distribution, Int, Tensor};
use burn_flash::{
    AttentionMask, FlashAttentionOptions, flash_attention_masked, flash_attention_plan,
};
use clap::builder::RangedU64ValueParser;
use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, ValueEnum};

use common::{Backend, Clear, ClearKind, Impl, median_ms, name, select_device, timed};

/// Attention timings of burn-flash against Burn's attention, as CSV (see the header of
/// `benches/attention.rs`).
#[derive(Parser, Debug)]
#[command(name = "attention", bin_name = "attention")]
struct Args {
    /// Head dims [default: 64,128 on CUDA, 64 on wgpu].
    #[arg(long, value_delimiter = ',')]
    d: Vec<usize>,
    /// Sequence lengths [default: 512,1024,2048,4096,8192,16384 on CUDA, 128,256,512 on wgpu].
    #[arg(long, value_delimiter = ',')]
    n: Vec<usize>,
    /// Batch size; 0 means 16384 / n on CUDA (the FlashAttention-2 shapes), 1024 / n on wgpu.
    #[arg(long, default_value_t = 0)]
    b: usize,
    /// Query heads; 0 means 2048 / d on CUDA, 256 / d on wgpu.
    #[arg(long, default_value_t = 0)]
    h: usize,
    /// Key/value heads (grouped-query attention); 0 means h. Every implementation gets k and v
    /// with this many heads.
    #[arg(long, default_value_t = 0)]
    hkv: usize,
    /// Which causal settings to run.
    #[arg(long, value_enum, default_value_t = Causal::Both)]
    causal: Causal,
    /// A sliding window of LEFT keys before each query's diagonal (burn-flash only; rows
    /// burn-flash-swaLEFT, whose TFLOPS count the visible pairs exactly).
    #[arg(long, value_name = "LEFT")]
    window: Option<usize>,
    /// Scores pass through CAP·tanh(s / CAP) (burn-flash only; rows burn-flash-capCAP).
    #[arg(long, value_name = "CAP")]
    softcap: Option<f64>,
    /// A boolean mask: keypad, the last eighth of every sequence's keys padded ([b, n]); full, a
    /// random mask per sequence ([b, 1, n, n], 10 % hidden); docs, documents of 1024 tokens
    /// packed into each sequence, each query seeing its own document's keys ([b, 1, n, n]).
    /// Rows IMPL-keypad, IMPL-mask or IMPL-docs; Burn's peers get it expanded to [b, h, n, n].
    /// TFLOPS count all n² pairs.
    #[arg(long, value_enum)]
    mask: Option<Mask>,
    /// heads: an additive bias per head ([1, h, n, n], as a relative-position bias), with its
    /// gradient in fwdbwd. Rows IMPL-bias; Burn's peers get it expanded.
    #[arg(long, value_enum)]
    bias: Option<Bias>,
    /// Attention dropout of probability P (burn-flash only; rows burn-flash-dropP).
    #[arg(long, value_name = "P")]
    dropout: Option<f64>,
    /// ALiBi's biases computed in the kernel (burn-flash only; rows burn-flash-alibi).
    #[arg(long)]
    alibi: bool,
    /// `with_deterministic(false)`: the backward adds dQ by atomics where that is the faster
    /// way (head dim 128 from 1024 keys, 2048 causal), else as by default (burn-flash only; rows
    /// burn-flash-atomicdq).
    #[arg(long)]
    atomic_dq: bool,
    /// The implementations to time.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "burn-flash,burn-unfused,burn-builtin"
    )]
    impls: Vec<Impl>,
    /// The inputs' dtype [default: bf16 on CUDA, f32 on wgpu].
    #[arg(long, value_enum)]
    dtype: Option<Precision>,
    /// The device: auto takes the first CUDA device where the build has CUDA and the machine a
    /// device, else wgpu.
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    backend: Backend,
    /// Timed samples per row [default: 30 on CUDA, 5 on wgpu].
    #[arg(long, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    iters: Option<usize>,
    /// Untimed calls after the first [default: 5 on CUDA, 2 on wgpu].
    #[arg(long)]
    warmup: Option<usize>,
    /// Independent input sets the calls rotate between.
    #[arg(long, default_value_t = 3, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    sets: usize,
    /// A call slower than this skips the row and the longer lengths [default: 2000 on CUDA,
    /// 20000 on wgpu].
    #[arg(long, value_name = "MS")]
    budget_ms: Option<f64>,
    /// Fewer samples (at least 3) where the row would take longer than this.
    #[arg(long, value_name = "S", default_value_t = 20.0)]
    row_seconds: f64,
    /// fwd: the forward; fwdbwd: forward and backward on the autodiff device.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "fwd")]
    modes: Vec<Mode>,
    /// Instead of timings, the device memory of one training step of --impls' first
    /// implementation per shape.
    #[arg(long)]
    memory: bool,
    /// With `fwdbwd`, also each implementation's gradients of the first input set (a random
    /// upstream gradient) against Burn's unfused attention in f32 on the same inputs: per
    /// gradient, its non-finite values and its largest difference over the reference's largest
    /// magnitude, as a `# grads` line of the CSV.
    #[arg(long)]
    check_grads: bool,
    /// A CSV of the same columns from another program on this device (torch_sdpa_bench.py),
    /// whose rows join the summary printed after the CSV.
    #[arg(long, value_name = "CSV")]
    peers: Option<PathBuf>,
    /// b2b: calls back to back. clear: a 256 MiB pass over a buffer before every call, as
    /// PyTorch's do_bench clears the L2 cache, and the calls timed by difference with a batch of
    /// clears alone (the clear's time goes to stderr; the summary's peak memory then includes
    /// the clear's two 128 MiB buffers).
    #[arg(long, value_enum, default_value_t = Timing::BackToBack)]
    timing: Timing,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Causal {
    Both,
    True,
    False,
}

impl Causal {
    fn settings(self) -> &'static [bool] {
        match self {
            Self::Both => &[false, true],
            Self::True => &[true],
            Self::False => &[false],
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mask {
    Keypad,
    Full,
    Docs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Bias {
    Heads,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Precision {
    Bf16,
    F16,
    F32,
}

impl Precision {
    fn dtype(self) -> DType {
        match self {
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
            Self::F32 => DType::F32,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    Fwd,
    Fwdbwd,
}

/// What runs between two timed calls (`--timing`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Timing {
    /// A pass over a buffer larger than the L2 cache before every call, as `do_bench` does.
    Clear,
    /// Nothing: calls back to back.
    #[value(name = "b2b")]
    BackToBack,
}

/// A flag value's name on the command line, which is also its name in the CSV.
fn fail(message: impl Display) -> ! {
    Args::command()
        .error(ErrorKind::InvalidValue, message)
        .exit()
}

/// What one run uses once the defaults of its device are filled in.
struct Settings {
    dtype: Precision,
    d: Vec<usize>,
    n: Vec<usize>,
    tokens: usize,
    hidden: usize,
    iters: usize,
    warmup: usize,
    budget: Duration,
}

/// Python's spelling of a bool, as `torch_sdpa_bench.py` prints it.
fn py_bool(value: bool) -> &'static str {
    if value { "True" } else { "False" }
}

/// Set by any panic in the process, including one on a device's server thread (a kernel that
/// failed to compile or launch), which the calling thread does not see: a row timed across one
/// is not reported.
static PANICKED: AtomicBool = AtomicBool::new(false);

fn watch_panics() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICKED.store(true, Ordering::SeqCst);
        previous(info);
    }));
}

fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    let text = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into());
    text.replace(['\n', ','], " ").chars().take(120).collect()
}

/// One input set: `q`, `k`, `v`, and the mask and bias when the run has them.
#[derive(Clone)]
struct Set {
    qkv: [Tensor<4>; 3],
    mask: Option<AttentionMask>,
    bias: Option<Tensor<4>>,
}

impl Set {
    /// Random inputs of these sizes on `device`, with the mask and bias `args` ask for.
    fn random(args: &Args, device: &Device, dtype: DType, [b, h, hkv, n, d]: [usize; 5]) -> Self {
        let normal = Distribution::Normal(0.0, 1.0);
        let qkv =
            [h, hkv, hkv].map(|heads| Tensor::random([b, heads, n, d], normal, (device, dtype)));
        let mask = args.mask.map(|kind| match kind {
            Mask::Keypad => {
                let keys = Tensor::<1, Int>::arange(0..n as i64, device);
                AttentionMask::KeyPadding(
                    keys.greater_equal_elem((n - n / 8) as i64)
                        .unsqueeze::<2>()
                        .repeat_dim(0, b),
                )
            }
            Mask::Docs => {
                let document = Tensor::<1, Int>::arange(0..n as i64, device).div_scalar(1024);
                let rows = document.clone().reshape([n, 1]).expand([n, n]);
                let cols = document.reshape([1, n]).expand([n, n]);
                AttentionMask::Full(
                    rows.not_equal(cols)
                        .reshape([1, 1, n, n])
                        .expand([b, 1, n, n]),
                )
            }
            Mask::Full => AttentionMask::Full(
                Tensor::<4>::random([b, 1, n, n], Distribution::Uniform(0.0, 1.0), device)
                    .lower_elem(0.1),
            ),
        });
        let bias = args
            .bias
            .map(|Bias::Heads| Tensor::random([1, h, n, n], normal, (device, dtype)));
        Self { qkv, mask, bias }
    }
}

/// The signature of Burn's `attention` and `attention_fallback`.
type BurnAttention = fn(
    Tensor<4>,
    Tensor<4>,
    Tensor<4>,
    Option<Tensor<4, Bool>>,
    Option<Tensor<4>>,
    AttentionModuleOptions,
) -> Tensor<4>;

/// One forward call of implementation `name`.
fn forward(name: Impl, set: Set, options: FlashAttentionOptions) -> Tensor<4> {
    let [q, k, v] = set.qkv;
    let op: BurnAttention = match name {
        Impl::Flash => return flash_attention_masked(q, k, v, set.mask, set.bias, options),
        Impl::Unfused => attention_fallback,
        Impl::Builtin => attention,
    };
    // Burn's attentions take grouped k and v as they are, and full masks and biases.
    let ([b, h, seq_q, _], [_, _, n, _]) = (q.dims(), k.dims());
    let scores = [b, h, seq_q, n];
    let mask = set.mask.map(|mask| match mask {
        AttentionMask::KeyPadding(padding) => padding.reshape([b, 1, 1, n]).expand(scores),
        AttentionMask::Full(mask) => mask.expand(scores),
    });
    let bias = set.bias.map(|bias| bias.expand(scores));
    op(q, k, v, mask, bias, options.into())
}

/// Query-key pairs of an `n × n` self-attention that a causal mask and a window of `left` keys
/// before the diagonal leave visible.
fn visible_pairs(n: usize, causal: bool, left: usize) -> f64 {
    (0..n)
        .map(|i| {
            let last = if causal { i } else { n - 1 };
            (last + 1 - i.saturating_sub(left)) as f64
        })
        .sum()
}

/// One training step of attention on the autodiff device: the forward of `name` on inputs (and
/// bias) that require gradients, then `backward()` of its output (all-ones upstream gradient).
fn forward_backward(name: Impl, set: Set, options: FlashAttentionOptions) {
    let set = Set {
        qkv: set.qkv.map(Tensor::require_grad),
        mask: set.mask,
        bias: set.bias.map(Tensor::require_grad),
    };
    let out = forward(name, set, options);
    let _grads = out.backward();
}

/// `--check-grads`: the gradients of `sum(upstream ∘ attention)` by `name` on `set`'s q, k and
/// v, against Burn's unfused attention in f32 on the same values, for each of dq, dk, dv: its
/// non-finite values and `max |got − ref| / max |ref|`.
fn check_grads(name: Impl, set: &Set, options: FlashAttentionOptions) -> String {
    let [q, _, v] = &set.qkv;
    let [b, h, n, _] = q.dims();
    let shape = [b, h, n, v.dims()[3]];
    let normal = Distribution::Normal(0.0, 1.0);
    let upstream = Tensor::<4>::random(shape, normal, (&q.device(), DType::F32));
    let grads = |name: Impl, dtype: DType| {
        let qkv = set.qkv.clone().map(|t| t.cast(dtype).require_grad());
        let inputs = Set {
            qkv: qkv.clone(),
            mask: set.mask.clone(),
            bias: set.bias.clone().map(|bias| bias.cast(dtype)),
        };
        let out = forward(name, inputs, options).cast(DType::F32);
        let grads = (out * upstream.clone()).sum().backward();
        qkv.map(|t| t.grad(&grads).map(|grad| grad.cast(DType::F32)))
    };
    let got = grads(name, q.dtype());
    let reference = grads(Impl::Unfused, DType::F32);
    let judged: Vec<String> = ["dq", "dk", "dv"]
        .iter()
        .zip(got.into_iter().zip(reference))
        .map(|(label, pair)| match pair {
            (Some(got), Some(reference)) => {
                let bad = got.clone().is_nan().bool_or(got.clone().is_inf());
                let non_finite: i64 = bad.int().sum().into_scalar();
                let scale: f32 = reference.clone().abs().max().into_scalar();
                let diff: f32 = (got - reference).abs().max().into_scalar();
                format!(
                    "{label} non-finite {non_finite} max diff / max |ref| {:.2e}",
                    diff / scale
                )
            }
            _ => format!("{label} missing"),
        })
        .collect();
    judged.join("; ")
}

/// What one timed call runs: [`forward`] or [`forward_backward`].
type Call = fn(Impl, Set, FlashAttentionOptions);

/// One row's calls: which implementation, how, on which inputs, with which options.
struct Row<'a> {
    call: Call,
    name: Impl,
    inputs: &'a [Set],
    options: FlashAttentionOptions,
}

impl Row<'_> {
    /// [`timed`] over `batch` calls from input set `first` on, each after a clear with `clear`.
    fn timed_batch(
        &self,
        device: &Device,
        first: usize,
        batch: usize,
        mut clear: Option<&mut Clear>,
    ) -> (Duration, Duration) {
        timed(device, batch, |i| {
            if let Some(clear) = clear.as_deref_mut() {
                clear.run();
            }
            let set = self.inputs[(first + i) % self.inputs.len()].clone();
            (self.call)(self.name, set, self.options);
        })
    }
}

/// How the last row of an (impl, d, causal) series went, to predict the next, longer one.
#[derive(Clone, Copy, Debug)]
enum Outcome {
    /// One call took `ms` for `flops`.
    Timed { ms: f64, flops: f64 },
    /// A call went over the budget.
    OverBudget,
    /// The call failed.
    Failed,
}

/// The rows' suffix for the options only burn-flash has (`--window`, `--softcap`, `--dropout`,
/// `--alibi`, `--atomic-dq`): empty without them.
fn flash_variant(args: &Args) -> String {
    let mut variant = String::new();
    if let Some(left) = args.window {
        variant += &format!("-swa{left}");
    }
    if let Some(cap) = args.softcap {
        variant += &format!("-cap{cap}");
    }
    if let Some(prob) = args.dropout {
        variant += &format!("-drop{prob}");
    }
    if args.alibi {
        variant += "-alibi";
    }
    if args.atomic_dq {
        variant += "-atomicdq";
    }
    variant
}

/// The rows' suffix for the mask and bias (`--mask`, `--bias`), which every implementation takes.
fn inputs_variant(args: &Args) -> String {
    let mut variant = match args.mask {
        Some(Mask::Keypad) => "-keypad",
        Some(Mask::Docs) => "-docs",
        Some(Mask::Full) => "-mask",
        None => "",
    }
    .to_string();
    if args.bias.is_some() {
        variant += "-bias";
    }
    variant
}

/// The options of a call with the causal mask `causal` and what `args` ask for.
fn options(args: &Args, causal: bool) -> FlashAttentionOptions {
    let mut options = FlashAttentionOptions::new()
        .with_causal(causal)
        .with_alibi(args.alibi)
        .with_deterministic(!args.atomic_dq);
    if let Some(left) = args.window {
        options = options.with_sliding_window(left);
    }
    if let Some(cap) = args.softcap {
        options = options.with_softcap(cap);
    }
    if let Some(prob) = args.dropout {
        options = options.with_dropout(prob, 7);
    }
    options
}

/// Time every shape of `s` in `mode` on `device` (the plain device for `fwd`, the autodiff one
/// for `fwdbwd`), each call running `call`.
fn run(device: &Device, args: &Args, s: &Settings, mode: Mode, call: Call, timed: &mut Vec<Timed>) {
    let mode_name = name(mode);
    let flash_variant = flash_variant(args);
    let inputs_variant = inputs_variant(args);
    let budget_ms = s.budget.as_secs_f64() * 1e3;
    let mut last: HashMap<(Impl, usize, bool), Outcome> = HashMap::new();
    for &d in &s.d {
        for &n in &s.n {
            let b = if args.b > 0 {
                args.b
            } else {
                (s.tokens / n).max(1)
            };
            let h = if args.h > 0 {
                args.h
            } else {
                (s.hidden / d).max(1)
            };
            let hkv = if args.hkv > 0 { args.hkv } else { h };
            device.seed(0);
            let inputs: Vec<Set> = (0..args.sets)
                .map(|_| Set::random(args, device, s.dtype.dtype(), [b, h, hkv, n, d]))
                .collect();
            for &causal in args.causal.settings() {
                let options = options(args, causal);
                // FlashAttention's convention: n² pairs, halved when causal; with a window, the
                // visible pairs exactly.
                let pairs = match args.window {
                    Some(left) => visible_pairs(n, causal, left),
                    None => (n * n) as f64 / if causal { 2.0 } else { 1.0 },
                };
                let forward_flops = 4.0 * (b * h * d) as f64 * pairs;
                let flops = forward_flops * if mode == Mode::Fwdbwd { 3.5 } else { 1.0 };
                let prefix = format!(
                    "{},{b},{h},{hkv},{n},{d},{}",
                    name(s.dtype),
                    py_bool(causal)
                );
                let [q, k, v] = &inputs[0].qkv;
                match flash_attention_plan(q, k, v, options) {
                    Ok(plan) => {
                        eprintln!(
                            "b {b} h {h} n {n} d {d} causal {causal}: burn-flash runs {plan}"
                        );
                        if !plan.is_fused() {
                            println!("# burn-flash,{prefix}: not fused here: {plan}");
                        }
                    }
                    Err(e) => eprintln!("burn-flash refuses b {b} h {h} n {n} d {d}: {e}"),
                }
                for &implementation in &args.impls {
                    let impl_name = name(implementation);
                    // Burn's attentions have no window, softcap, dropout or ALiBi option.
                    if !flash_variant.is_empty() && implementation != Impl::Flash {
                        println!(
                            "# {impl_name},{prefix},{mode_name} skipped: no{flash_variant} variant"
                        );
                        continue;
                    }
                    let variant = format!("{flash_variant}{inputs_variant}");
                    let row = format!("{impl_name}{variant},{prefix}");
                    let key = (implementation, d, causal);
                    // A peer too slow at a shorter length is not started again: its first call
                    // (compilation, autotune) cannot be interrupted.
                    match last.get(&key) {
                        Some(Outcome::OverBudget) => {
                            println!(
                                "# {row},{mode_name} skipped: over the budget at a shorter length"
                            );
                            continue;
                        }
                        Some(&Outcome::Timed { ms, flops: before }) => {
                            let predicted = ms * flops / before;
                            if predicted > budget_ms {
                                println!(
                                    "# {row},{mode_name} skipped: {predicted:.0} ms per call \
                                     predicted from the shorter length, over the budget of \
                                     {budget_ms:.0} ms"
                                );
                                last.insert(key, Outcome::OverBudget);
                                continue;
                            }
                        }
                        _ => {}
                    }
                    let row = format!("{row},{mode_name}");
                    // Pages left by earlier rows go back, so what the pools hold after this
                    // row is its own high-water mark (at page granularity, inputs included).
                    device.memory_cleanup();
                    let calls = Row {
                        call,
                        name: implementation,
                        inputs: &inputs,
                        options,
                    };
                    let outcome = measure(device, &calls, &row, flops, s, args);
                    if mode == Mode::Fwdbwd && args.check_grads {
                        let check = check_grads(implementation, &inputs[0], options);
                        println!("# grads {row}: {check}");
                    }
                    if let Outcome::Timed { ms, .. } = outcome {
                        timed.push(Timed {
                            name: format!("{impl_name}{variant}"),
                            shape: format!("{prefix},{mode_name}"),
                            ms,
                            peak: device.memory_pool_usage().map(|usage| usage.bytes_reserved),
                        });
                    }
                    last.insert(key, outcome);
                }
            }
        }
    }
}

/// Warm up, time and print one row.
fn measure(
    device: &Device,
    calls: &Row,
    row: &str,
    flops: f64,
    s: &Settings,
    args: &Args,
) -> Outcome {
    PANICKED.store(false, Ordering::SeqCst);
    let result = catch_unwind(AssertUnwindSafe(|| {
        let mut clear =
            (args.timing == Timing::Clear).then(|| Clear::new(device, ClearKind::Write));
        // First call: compilation and autotune, not timed against the budget.
        let (first, _) = calls.timed_batch(device, 0, 1, clear.as_mut());
        eprintln!("{row}: first call {first:.2?}");
        let (probe, _) = calls.timed_batch(device, 1, 1, clear.as_mut());
        if probe > s.budget {
            return Err(format!(
                "one call took {:.1} ms, over the budget of {:.0} ms",
                probe.as_secs_f64() * 1e3,
                s.budget.as_secs_f64() * 1e3
            ));
        }
        for i in 1..s.warmup {
            calls.timed_batch(device, i + 1, 1, clear.as_mut());
        }
        // Batches of about 20 ms; the row kept under `row_seconds`, with at least 3 samples.
        let probe_s = probe.as_secs_f64().max(1e-6);
        let batch = ((0.02 / probe_s) as usize).clamp(1, 50);
        let affordable = (args.row_seconds / (probe_s * batch as f64)) as usize;
        let iters = s.iters.min(affordable.max(3));
        let mut times = Vec::with_capacity(iters);
        let mut issued = Vec::with_capacity(iters);
        let mut clears = Vec::with_capacity(iters);
        for i in 0..iters {
            // Clears alone first, then clears and calls: the difference is the calls'.
            let alone = clear
                .as_mut()
                .map(|clear| timed(device, batch, |_| clear.run()).0)
                .unwrap_or_default();
            let (time, issue) = calls.timed_batch(device, i * batch, batch, clear.as_mut());
            times.push(time.saturating_sub(alone));
            issued.push(issue);
            clears.push(alone);
        }
        Ok((
            median_ms(&mut times),
            median_ms(&mut issued),
            median_ms(&mut clears),
            iters * batch,
        ))
    }));
    let result = match result {
        Ok(Ok(_)) if PANICKED.load(Ordering::SeqCst) => {
            Err(Box::new("a panic on another thread (see stderr)".to_string()) as _)
        }
        other => other,
    };
    match result {
        Ok(Ok((ms, issue_ms, clear_ms, iters))) => {
            let tflops = flops / ms / 1e9;
            // One decimal as torch_sdpa_bench.py prints; more where it would read 0.0 (a CPU).
            let digits = if tflops < 1.0 { 4 } else { 1 };
            println!("{row},{ms:.4},{tflops:.digits$}");
            let method = match args.timing {
                Timing::Clear => {
                    format!("a clear before each ({clear_ms:.4} ms per clear alone, subtracted)")
                }
                Timing::BackToBack => "back to back".to_string(),
            };
            eprintln!(
                "{row}: {iters} calls, {method}, median of the batches' per-call times; \
                 the host issued a call in {issue_ms:.4} ms"
            );
            Outcome::Timed { ms, flops }
        }
        Ok(Err(skip)) => {
            println!("# {row} skipped: {skip}");
            Outcome::OverBudget
        }
        Err(payload) => {
            println!("{row},nan,nan  # error: {}", panic_text(payload));
            Outcome::Failed
        }
    }
}

fn settings(args: &Args, cuda: bool) -> Settings {
    let or = |given: &[usize], default: &[usize]| {
        if given.is_empty() {
            default.to_vec()
        } else {
            given.to_vec()
        }
    };
    if cuda {
        Settings {
            dtype: args.dtype.unwrap_or(Precision::Bf16),
            d: or(&args.d, &[64, 128]),
            n: or(&args.n, &[512, 1024, 2048, 4096, 8192, 16384]),
            tokens: 16384,
            hidden: 2048,
            iters: args.iters.unwrap_or(30),
            warmup: args.warmup.unwrap_or(5),
            budget: Duration::from_secs_f64(args.budget_ms.unwrap_or(2000.0) / 1e3),
        }
    } else {
        Settings {
            dtype: args.dtype.unwrap_or(Precision::F32),
            d: or(&args.d, &[64]),
            n: or(&args.n, &[128, 256, 512]),
            tokens: 1024,
            hidden: 256,
            iters: args.iters.unwrap_or(5),
            warmup: args.warmup.unwrap_or(2),
            budget: Duration::from_secs_f64(args.budget_ms.unwrap_or(20000.0) / 1e3),
        }
    }
}

/// Every requested mode on `device` (its autodiff device for `fwdbwd`), then the summary.
fn run_modes(device: &Device, args: &Args, s: &Settings) {
    let peers = args.peers.as_deref().map(read_peers).unwrap_or_default();
    println!("impl,dtype,b,h,hkv,n,d,causal,mode,ms,tflops");
    println!(
        "# timing: {}",
        match args.timing {
            Timing::Clear => "clear (a 256 MiB pass before each call, as do_bench; --timing)",
            Timing::BackToBack => "b2b (calls back to back; --timing)",
        }
    );
    let mut timed = Vec::new();
    for &mode in &args.modes {
        match mode {
            Mode::Fwd => {
                let forward_only: Call = |name, set, options| {
                    forward(name, set, options);
                };
                run(device, args, s, mode, forward_only, &mut timed);
            }
            Mode::Fwdbwd => {
                let autodiff = device.clone().autodiff();
                run(&autodiff, args, s, mode, forward_backward, &mut timed);
            }
        }
    }
    summary(&timed, &peers);
}

/// One timed row for the summary: implementation, the CSV columns from `dtype` to `mode`, the
/// time per call, and the bytes the memory pools held after the row (its peak).
struct Timed {
    name: String,
    shape: String,
    ms: f64,
    peak: Option<u64>,
}

/// The timed rows of a CSV with this benchmark's columns (`--peers`, e.g. torch_sdpa_bench.py's
/// output from the same device); comment lines, the header and `nan` rows are skipped.
fn read_peers(path: &Path) -> Vec<Timed> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| fail(format!("--peers {}: {e}", path.display())));
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.starts_with("impl,"))
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            let ms: f64 = fields.get(9)?.parse().ok()?;
            (fields.len() >= 11 && ms.is_finite()).then(|| Timed {
                name: fields[0].to_string(),
                shape: fields[1..9].join(","),
                ms,
                peak: None,
            })
        })
        .collect()
}

/// After the CSV, as `#` lines that CSV readers skip: per shape burn-flash ran, its time and peak
/// device memory, and its speed-up over each peer that ran the same shape (peer time / ours,
/// with the peer's peak memory where this process measured it); then, per mode and peer, the
/// geometric mean of those speed-ups.
fn summary(timed: &[Timed], peers: &[Timed]) {
    let gib = |peak: Option<u64>| {
        peak.map(|bytes| format!(" ({:.2} GiB)", bytes as f64 / (1u64 << 30) as f64))
            .unwrap_or_default()
    };
    let mut means: Vec<(String, String, f64, usize)> = Vec::new();
    println!(
        "# summary: burn-flash's time and peak device memory per row, and its speed-up over \
         each peer (the peer's time / burn-flash's)"
    );
    // burn-flash's rows, named `burn-flash` or with a variant (`burn-flash-keypad`, ...).
    let flash = name(Impl::Flash);
    for ours in timed.iter().filter(|t| t.name.starts_with(&flash)) {
        let mode = ours
            .shape
            .rsplit(',')
            .next()
            .unwrap_or_default()
            .to_string();
        let mut line = format!(
            "# {}: {} {:.4} ms{}",
            ours.shape,
            ours.name,
            ours.ms,
            gib(ours.peak)
        );
        for peer in timed
            .iter()
            .chain(peers)
            .filter(|t| t.shape == ours.shape && t.name != ours.name)
        {
            let speedup = peer.ms / ours.ms;
            line += &format!("; {speedup:.2}x {}{}", peer.name, gib(peer.peak));
            match means.iter_mut().find(|m| m.0 == mode && m.1 == peer.name) {
                Some(m) => {
                    m.2 += speedup.ln();
                    m.3 += 1;
                }
                None => means.push((mode.clone(), peer.name.clone(), speedup.ln(), 1)),
            }
        }
        println!("{line}");
    }
    for (mode, peer, log_sum, count) in means {
        println!(
            "# geometric mean over {count} {mode} rows: burn-flash {:.3}x {peer}",
            (log_sum / count as f64).exp()
        );
    }
}

/// `--memory`: one training step per shape of the first implementation, and the memory the
/// device's pools hold afterwards.
fn memory(device: &Device, args: &Args, s: &Settings) {
    let device = device.clone().autodiff();
    let implementation = args.impls[0];
    println!("impl,dtype,b,h,n,d,causal,bytes_reserved,bytes_in_use");
    for &d in &s.d {
        for &n in &s.n {
            for &causal in args.causal.settings() {
                let (b, h) = (args.b.max(1), args.h.max(1));
                let inputs = Set::random(args, &device, s.dtype.dtype(), [b, h, h, n, d]);
                let options = FlashAttentionOptions::new().with_causal(causal);
                let row = format!(
                    "{},{},{b},{h},{n},{d},{}",
                    name(implementation),
                    name(s.dtype),
                    py_bool(causal)
                );
                let step = catch_unwind(AssertUnwindSafe(|| {
                    forward_backward(implementation, inputs, options);
                    device.sync().expect("device sync");
                }));
                match (step, device.memory_pool_usage()) {
                    (Ok(()), Some(usage)) => {
                        println!("{row},{},{}", usage.bytes_reserved, usage.bytes_in_use)
                    }
                    (Err(payload), _) => {
                        println!("{row},nan,nan  # error: {}", panic_text(payload))
                    }
                    (Ok(()), None) => println!("{row},nan,nan  # the device reports no usage"),
                }
            }
        }
    }
}

/// The device `--backend` asks for, and whether it is a CUDA device.
fn main() {
    // `cargo bench` passes `--bench` to every benchmark program.
    let args = Args::parse_from(std::env::args().filter(|arg| arg != "--bench"));
    watch_panics();
    let (device, cuda) = select_device(args.backend).unwrap_or_else(|reason| fail(reason));
    let s = settings(&args, cuda);
    if args.memory {
        memory(&device, &args, &s);
    } else {
        run_modes(&device, &args, &s);
    }
}
