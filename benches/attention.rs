//! Attention timings: `burn-flash` (this crate's fused op) against Burn's own
//! `attention_fallback` (`burn-unfused`) and `attention` (`burn-builtin`), forward (`fwd`) and
//! forward + backward through `Autodiff` (`fwdbwd`: one call, then `backward()` of its output),
//! as CSV on stdout with the columns of `../shared/tools/torch_sdpa_bench.py`, so both tables can
//! be joined:
//!
//! ```text
//! impl,dtype,b,h,hkv,n,d,causal,mode,ms,tflops
//! ```
//!
//! On CUDA (built with `--features cuda` and a device present) it runs bf16 on the
//! FlashAttention-2 shapes: 16k tokens (`b = 16384 / n`), hidden 2048 (`h = 2048 / d`),
//! `n` 512..16384, `d` 64 and 128, causal and not. Elsewhere it runs f32 on `burn::backend::Wgpu`
//! with small shapes (it may be lavapipe, a CPU).
//!
//! Method: a first call (compilation, autotune) and `--warmup` more calls are not timed; then
//! `--iters` samples, each a batch of calls issued back to back between two device
//! synchronisations (as many as fill about 20 ms, at most 50), rotating between `--sets`
//! independent input sets so no call finds its inputs in cache; the median of the samples'
//! per-call times is reported. The host prepares the next call while the device runs this one,
//! so a synchronisation per call is not charged to the kernels.
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
//! TFLOPS counts `4·b·h·n²·d`, halved when causal, times 3.5 for `fwdbwd`. A call slower than `--budget-ms` skips the
//! row with a `#` comment line, and so do the longer lengths of that implementation (also when
//! the last length's time, scaled by the FLOPs, predicts a call over the budget: a first call,
//! with its autotune, cannot be interrupted); a call that fails prints its row with `nan`
//! times and the error as a comment.
//!
//! ```text
//! cargo bench --features cuda --bench attention -- --d 64,128 --n 1024,4096 --causal both
//! ```
//!
//! After the CSV comes a summary as `#` lines (CSV readers skip them): per shape, burn-flash's
//! time and the device memory the pools held after its row (the row's high-water mark at page
//! granularity, inputs included; pages of earlier rows are released before each row), and its
//! speed-up over each peer that ran the shape, with the geometric mean per mode and peer. Rows
//! of another program on the same device, e.g. `torch_sdpa_bench.py`'s CSV, join the summary
//! with `--peers FILE`.
//!
//! `--memory` (CUDA) instead runs one training step (forward + backward of `--impls`' first
//! implementation) per length and prints the device memory CubeCL's pools hold afterwards
//! (`bytes_reserved`, the high-water mark of the step: pools keep their pages) and what is
//! still allocated (`bytes_in_use`). Run one length per process for clean figures.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Autodiff, Wgpu};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::module::{attention, attention_fallback};
use burn::tensor::{Bool, DType, Distribution, Int, Tensor};
use burn_flash::{
    AttentionMask, FlashAttentionBackend, FlashAttentionOptions, flash_attention_masked,
    flash_attention_plan,
};

const USAGE: &str = "\
usage: attention [--d 64,128] [--n 512,1024,...] [--b B] [--h H] [--hkv HKV]
                 [--causal both|true|false] [--window LEFT] [--softcap CAP]
                 [--mask keypad|full|docs] [--bias heads] [--dropout P] [--alibi] [--atomic-dq]
                 [--impls burn-flash,burn-unfused,burn-builtin] [--dtype bf16|f16|f32]
                 [--backend auto|cuda|cuda-bare|wgpu] [--iters N] [--warmup N] [--sets N]
                 [--budget-ms MS] [--row-seconds S] [--modes fwd,fwdbwd] [--memory]
                 [--peers CSV] [--timing clear|b2b]
--b / --h: 0 (default) means 16384 / n and 2048 / d on CUDA (the FlashAttention-2 shapes),
           1024 / n and 256 / d on wgpu.
--hkv:     key/value heads (grouped-query attention); 0 (default) means h. Burn's peers get
           k and v expanded to h heads, as a Burn model without a GQA kernel would.
--window:  a sliding window of LEFT keys before each query's diagonal (burn-flash only; its
           rows are named burn-flash-swaLEFT, their TFLOPS count the visible pairs exactly).
--softcap: scores pass through CAP·tanh(s / CAP) (burn-flash only; rows burn-flash-capCAP).
--mask:    a boolean mask: keypad, the last eighth of every sequence's keys padded ([b, n]);
           full, a random mask per sequence ([b, 1, n, n], 10 % hidden); docs, documents of
           1024 tokens packed into each sequence, each query seeing its own document's keys
           ([b, 1, n, n]). Rows IMPL-keypad, IMPL-mask or IMPL-docs; Burn's peers get it
           expanded to [b, h, n, n]. TFLOPS count all n² pairs.
--bias:    heads, an additive bias per head ([1, h, n, n], as a relative-position bias), with
           its gradient in fwdbwd. Rows IMPL-bias; Burn's peers get it expanded.
--dropout: attention dropout of probability P (burn-flash only; rows burn-flash-dropP).
--alibi:   ALiBi's biases computed in the kernel (burn-flash only; rows burn-flash-alibi).
--atomic-dq: `with_deterministic(false)`: the backward adds dQ by atomics where that is the
           faster way (head dim 128 from 1024 keys, 2048 causal), else as by default
           (burn-flash only; rows burn-flash-atomicdq).
--peers:   a CSV of the same columns from another program on this device (torch_sdpa_bench.py),
           whose rows join the summary printed after the CSV.
--timing:  b2b (default): calls back to back. clear: a 256 MiB pass over a buffer before
           every call, as PyTorch's do_bench clears the L2 cache, and the calls timed by
           difference with a batch of clears alone (the clear's time goes to stderr; the
           summary's peak memory then includes the clear's two 128 MiB buffers).
--backend: cuda-bare times Burn's CubeBackend without the fusion stream (what the stream costs
           per call); stderr also gives the host's time to issue one call per row.";

const IMPLS: [&str; 3] = ["burn-flash", "burn-unfused", "burn-builtin"];

#[derive(Clone, Debug)]
struct Args {
    d: Vec<usize>,
    n: Vec<usize>,
    b: usize,
    h: usize,
    hkv: usize,
    window: Option<usize>,
    softcap: Option<f64>,
    dropout: Option<f64>,
    alibi: bool,
    atomic_dq: bool,
    mask: Option<String>,
    bias: bool,
    causal: Vec<bool>,
    impls: Vec<String>,
    dtype: Option<DType>,
    backend: String,
    iters: Option<usize>,
    warmup: Option<usize>,
    sets: usize,
    budget_ms: Option<f64>,
    row_seconds: f64,
    modes: Vec<String>,
    memory: bool,
    peers: Option<String>,
    timing: Timing,
}

/// What runs between two timed calls (`--timing`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Timing {
    /// A pass over a buffer larger than the L2 cache before every call, as `do_bench` does.
    Clear,
    /// Nothing: calls back to back.
    BackToBack,
}

fn list(value: &str) -> Vec<usize> {
    value
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.trim()
                .parse()
                .unwrap_or_else(|_| fail(&format!("not a number: {s}")))
        })
        .collect()
}

fn fail(message: &str) -> ! {
    eprintln!("{message}\n{USAGE}");
    std::process::exit(2);
}

fn parse_args() -> Args {
    let mut args = Args {
        d: Vec::new(),
        n: Vec::new(),
        b: 0,
        h: 0,
        hkv: 0,
        window: None,
        softcap: None,
        dropout: None,
        alibi: false,
        atomic_dq: false,
        mask: None,
        bias: false,
        causal: vec![false, true],
        impls: IMPLS.iter().map(|s| s.to_string()).collect(),
        dtype: None,
        backend: "auto".into(),
        iters: None,
        warmup: None,
        sets: 3,
        budget_ms: None,
        row_seconds: 20.0,
        modes: vec!["fwd".into()],
        memory: false,
        peers: None,
        timing: Timing::BackToBack,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        // `cargo bench` passes `--bench`; a bare word is a cargo filter. Neither concerns us.
        if flag == "--bench" || !flag.starts_with("--") {
            continue;
        }
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        if flag == "--memory" {
            args.memory = true;
            continue;
        }
        if flag == "--alibi" {
            args.alibi = true;
            continue;
        }
        if flag == "--atomic-dq" {
            args.atomic_dq = true;
            continue;
        }
        let value = it
            .next()
            .unwrap_or_else(|| fail(&format!("{flag} needs a value")));
        let number = |v: &str| -> f64 {
            v.parse()
                .unwrap_or_else(|_| fail(&format!("{flag}: not a number: {v}")))
        };
        match flag.as_str() {
            "--d" => args.d = list(&value),
            "--n" => args.n = list(&value),
            "--b" => args.b = number(&value) as usize,
            "--h" => args.h = number(&value) as usize,
            "--hkv" => args.hkv = number(&value) as usize,
            "--window" => args.window = Some(number(&value) as usize),
            "--softcap" => args.softcap = Some(number(&value)),
            "--dropout" => args.dropout = Some(number(&value)),
            "--mask" => {
                if !matches!(value.as_str(), "keypad" | "full" | "docs") {
                    fail("--mask takes keypad, full or docs");
                }
                args.mask = Some(value);
            }
            "--bias" => {
                if value != "heads" {
                    fail("--bias takes heads");
                }
                args.bias = true;
            }
            "--causal" => {
                args.causal = match value.as_str() {
                    "both" => vec![false, true],
                    "true" => vec![true],
                    "false" => vec![false],
                    _ => fail("--causal takes both, true or false"),
                }
            }
            "--impls" => {
                args.impls = value.split(',').map(str::to_string).collect();
                if let Some(bad) = args.impls.iter().find(|i| !IMPLS.contains(&i.as_str())) {
                    fail(&format!("unknown impl {bad}; known: {}", IMPLS.join(",")));
                }
            }
            "--dtype" => {
                args.dtype = Some(match value.as_str() {
                    "bf16" => DType::BF16,
                    "f16" => DType::F16,
                    "f32" => DType::F32,
                    _ => fail("--dtype takes bf16, f16 or f32"),
                })
            }
            "--backend" => {
                if !matches!(value.as_str(), "auto" | "cuda" | "cuda-bare" | "wgpu") {
                    fail("--backend takes auto, cuda, cuda-bare or wgpu");
                }
                args.backend = value;
            }
            "--iters" => args.iters = Some((number(&value) as usize).max(1)),
            "--warmup" => args.warmup = Some(number(&value) as usize),
            "--sets" => args.sets = (number(&value) as usize).max(1),
            "--budget-ms" => args.budget_ms = Some(number(&value)),
            "--row-seconds" => args.row_seconds = number(&value),
            "--peers" => args.peers = Some(value),
            "--timing" => {
                args.timing = match value.as_str() {
                    "clear" => Timing::Clear,
                    "b2b" => Timing::BackToBack,
                    _ => fail("--timing takes clear or b2b"),
                }
            }
            "--modes" => {
                args.modes = value.split(',').map(str::to_string).collect();
                if args
                    .modes
                    .iter()
                    .any(|m| !matches!(m.as_str(), "fwd" | "fwdbwd"))
                {
                    fail("--modes takes fwd, fwdbwd or both");
                }
            }
            _ => fail(&format!("unknown flag {flag}")),
        }
    }
    args
}

/// What one backend run uses once the defaults of its device are filled in.
struct Settings {
    dtype: DType,
    d: Vec<usize>,
    n: Vec<usize>,
    tokens: usize,
    hidden: usize,
    iters: usize,
    warmup: usize,
    budget: Duration,
}

fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F32 => "f32",
        _ => "other",
    }
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

fn median_ms(times: &mut [Duration]) -> f64 {
    times.sort_unstable();
    let mid = times.len() / 2;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    if times.len() % 2 == 1 {
        ms(times[mid])
    } else {
        (ms(times[mid - 1]) + ms(times[mid])) / 2.0
    }
}

/// One input set: `q`, `k`, `v`, and the mask and bias when the run has them.
#[derive(Clone)]
struct Set<B: FlashAttentionBackend> {
    qkv: [Tensor<B, 4>; 3],
    mask: Option<AttentionMask<B>>,
    bias: Option<Tensor<B, 4>>,
}

impl<B: FlashAttentionBackend> Set<B> {
    /// Random inputs of these sizes, with the mask and bias `args` ask for.
    #[allow(clippy::too_many_arguments)]
    fn random(
        args: &Args,
        device: &B::Device,
        dtype: DType,
        [b, h, hkv, n, d]: [usize; 5],
    ) -> Self {
        let normal = Distribution::Normal(0.0, 1.0);
        let qkv =
            [h, hkv, hkv].map(|heads| Tensor::random([b, heads, n, d], normal, (device, dtype)));
        let mask = args.mask.as_deref().map(|kind| match kind {
            "keypad" => {
                let keys = Tensor::<B, 1, burn::tensor::Int>::arange(0..n as i64, device);
                AttentionMask::KeyPadding(
                    keys.greater_equal_elem((n - n / 8) as i64)
                        .unsqueeze::<2>()
                        .repeat_dim(0, b),
                )
            }
            "docs" => {
                let document =
                    Tensor::<B, 1, burn::tensor::Int>::arange(0..n as i64, device).div_scalar(1024);
                let rows = document.clone().reshape([n, 1]).expand([n, n]);
                let cols = document.reshape([1, n]).expand([n, n]);
                AttentionMask::Full(
                    rows.not_equal(cols)
                        .reshape([1, 1, n, n])
                        .expand([b, 1, n, n]),
                )
            }
            _ => AttentionMask::Full(
                Tensor::<B, 4>::random([b, 1, n, n], Distribution::Uniform(0.0, 1.0), device)
                    .lower_elem(0.1),
            ),
        });
        let bias = args
            .bias
            .then(|| Tensor::random([1, h, n, n], normal, (device, dtype)));
        Self { qkv, mask, bias }
    }
}

/// One forward call of implementation `name`.
fn forward<B: FlashAttentionBackend>(
    name: &str,
    set: Set<B>,
    options: FlashAttentionOptions,
) -> Tensor<B, 4> {
    let [q, k, v] = set.qkv;
    if name == "burn-flash" {
        return flash_attention_masked(q, k, v, set.mask, set.bias, options);
    }
    // Burn's attention wants as many key/value heads as query heads, and full masks and biases.
    let ([b, h, _, _], [_, hkv, n, d]) = (q.dims(), k.dims());
    let expand = |t: Tensor<B, 4>| {
        t.unsqueeze_dim::<5>(2)
            .expand([b, hkv, h / hkv, n, d])
            .reshape([b, h, n, d])
    };
    let (k, v) = if hkv == h {
        (k, v)
    } else {
        (expand(k), expand(v))
    };
    let seq_q = q.dims()[2];
    let scores = [b, h, seq_q, n];
    let mask: Option<Tensor<B, 4, Bool>> = set.mask.map(|mask| match mask {
        AttentionMask::KeyPadding(padding) => padding.reshape([b, 1, 1, n]).expand(scores),
        AttentionMask::Full(mask) => mask.expand(scores),
    });
    let bias = set.bias.map(|bias| bias.expand(scores));
    match name {
        "burn-unfused" => attention_fallback(q, k, v, mask, bias, options.into()),
        "burn-builtin" => attention(q, k, v, mask, bias, options.into()),
        _ => unreachable!("impls are checked when parsing"),
    }
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

/// One training step of attention: the forward of `name` on inputs (and bias) that require
/// gradients, then `backward()` of its output (all-ones upstream gradient).
fn forward_backward<B: FlashAttentionBackend + AutodiffBackend>(
    name: &str,
    set: Set<B>,
    options: FlashAttentionOptions,
) {
    let set = Set {
        qkv: set.qkv.map(Tensor::require_grad),
        mask: set.mask,
        bias: set.bias.map(Tensor::require_grad),
    };
    let out = forward(name, set, options);
    let _grads = out.backward();
}

/// What one timed call runs: [`forward`] or [`forward_backward`].
type Call<B> = fn(&str, Set<B>, FlashAttentionOptions);

/// The buffer `--timing clear` passes over before each call: 128 MiB of `i32`, reversed (read
/// and written: 256 MiB moved, more than the 50 MB L2 cache of an H100 holds). A reversal is a
/// gather, which Burn's fusion does not merge into the next reversal, so each clear runs as a
/// kernel of its own.
struct Clear<B: FlashAttentionBackend>(Tensor<B, 1, Int>);

impl<B: FlashAttentionBackend> Clear<B> {
    fn new(device: &B::Device) -> Self {
        Self(Tensor::zeros([32 << 20], device))
    }

    fn run(&mut self) {
        self.0 = self.0.clone().flip([0]);
    }
}

/// `batch` steps issued back to back, synchronised once at the end: the wall time per step,
/// and the host's time per step to issue them (the device is starved when the two are close).
fn timed<B: FlashAttentionBackend>(
    device: &B::Device,
    batch: usize,
    mut step: impl FnMut(usize),
) -> (Duration, Duration) {
    B::sync(device).expect("device sync");
    let start = Instant::now();
    for i in 0..batch {
        step(i);
    }
    let issued = start.elapsed();
    B::sync(device).expect("device sync");
    (start.elapsed() / batch as u32, issued / batch as u32)
}

/// [`timed`] over `batch` calls from input set `first` on, each after a clear with `clear`.
#[allow(clippy::too_many_arguments)]
fn timed_batch<B: FlashAttentionBackend>(
    device: &B::Device,
    call: Call<B>,
    name: &str,
    inputs: &[Set<B>],
    first: usize,
    batch: usize,
    options: FlashAttentionOptions,
    mut clear: Option<&mut Clear<B>>,
) -> (Duration, Duration) {
    timed::<B>(device, batch, |i| {
        if let Some(clear) = clear.as_deref_mut() {
            clear.run();
        }
        call(name, inputs[(first + i) % inputs.len()].clone(), options);
    })
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

/// Time every shape of `s` in `mode` ("fwd" or "fwdbwd", run by `call`).
#[allow(clippy::too_many_arguments)]
fn run<B: FlashAttentionBackend>(
    device: B::Device,
    args: &Args,
    s: &Settings,
    mode: &str,
    call: Call<B>,
    reserved: &dyn Fn() -> Option<u64>,
    timed: &mut Vec<Timed>,
) {
    let mut last: HashMap<(String, usize, bool), Outcome> = HashMap::new();
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
            B::seed(&device, 0);
            let inputs: Vec<Set<B>> = (0..args.sets)
                .map(|_| Set::random(args, &device, s.dtype, [b, h, hkv, n, d]))
                .collect();
            for &causal in &args.causal {
                let mut options = FlashAttentionOptions::new().with_causal(causal);
                // FlashAttention's convention: n² pairs, halved when causal; with a window, the
                // visible pairs exactly.
                let pairs = match args.window {
                    Some(left) => {
                        options = options.with_sliding_window(left);
                        visible_pairs(n, causal, left)
                    }
                    None => (n * n) as f64 / if causal { 2.0 } else { 1.0 },
                };
                if let Some(cap) = args.softcap {
                    options = options.with_softcap(cap);
                }
                if let Some(prob) = args.dropout {
                    options = options.with_dropout(prob, 7);
                }
                options = options
                    .with_alibi(args.alibi)
                    .with_deterministic(!args.atomic_dq);
                let forward_flops = 4.0 * (b * h * d) as f64 * pairs;
                let flops = forward_flops * if mode == "fwdbwd" { 3.5 } else { 1.0 };
                let prefix = format!(
                    "{},{b},{h},{hkv},{n},{d},{}",
                    dtype_name(s.dtype),
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
                for name in &args.impls {
                    // Burn's attentions have no window, softcap, dropout or ALiBi option.
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
                    if !variant.is_empty() && name != "burn-flash" {
                        println!("# {name},{prefix},{mode} skipped: no{variant} variant");
                        continue;
                    }
                    // Masks and biases all take.
                    match args.mask.as_deref() {
                        Some("keypad") => variant += "-keypad",
                        Some("docs") => variant += "-docs",
                        Some(_) => variant += "-mask",
                        None => {}
                    }
                    if args.bias {
                        variant += "-bias";
                    }
                    let row = format!("{name}{variant},{prefix}");
                    let key = (name.clone(), d, causal);
                    // A peer too slow at a shorter length is not started again: its first call
                    // (compilation, autotune) cannot be interrupted.
                    let budget_ms = s.budget.as_secs_f64() * 1e3;
                    match last.get(&key) {
                        Some(Outcome::OverBudget) => {
                            println!("# {row},{mode} skipped: over the budget at a shorter length");
                            continue;
                        }
                        Some(&Outcome::Timed { ms, flops: before }) => {
                            let predicted = ms * flops / before;
                            if predicted > budget_ms {
                                println!(
                                    "# {row},{mode} skipped: {predicted:.0} ms per call predicted \
                                     from the shorter length, over the budget of {budget_ms:.0} ms"
                                );
                                last.insert(key, Outcome::OverBudget);
                                continue;
                            }
                        }
                        _ => {}
                    }
                    let row = format!("{row},{mode}");
                    // Pages left by earlier rows go back, so what the pools hold after this
                    // row is its own high-water mark (at page granularity, inputs included).
                    B::memory_cleanup(&device);
                    let outcome =
                        measure(&device, call, name, &row, &inputs, options, flops, s, args);
                    if let Outcome::Timed { ms, .. } = outcome {
                        timed.push(Timed {
                            name: format!("{name}{variant}"),
                            shape: format!("{prefix},{mode}"),
                            ms,
                            peak: reserved(),
                        });
                    }
                    last.insert(key, outcome);
                }
            }
        }
    }
}

/// Warm up, time and print one row.
#[allow(clippy::too_many_arguments)]
fn measure<B: FlashAttentionBackend>(
    device: &B::Device,
    call: Call<B>,
    name: &str,
    row: &str,
    inputs: &[Set<B>],
    options: FlashAttentionOptions,
    flops: f64,
    s: &Settings,
    args: &Args,
) -> Outcome {
    PANICKED.store(false, Ordering::SeqCst);
    let result = catch_unwind(AssertUnwindSafe(|| {
        let mut clear = (args.timing == Timing::Clear).then(|| Clear::<B>::new(device));
        // First call: compilation and autotune, not timed against the budget.
        let (first, _) = timed_batch(device, call, name, inputs, 0, 1, options, clear.as_mut());
        eprintln!("{row}: first call {first:.2?}");
        let (probe, _) = timed_batch(device, call, name, inputs, 1, 1, options, clear.as_mut());
        if probe > s.budget {
            return Err(format!(
                "one call took {:.1} ms, over the budget of {:.0} ms",
                probe.as_secs_f64() * 1e3,
                s.budget.as_secs_f64() * 1e3
            ));
        }
        for i in 1..s.warmup {
            timed_batch(
                device,
                call,
                name,
                inputs,
                i + 1,
                1,
                options,
                clear.as_mut(),
            );
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
                .map(|clear| timed::<B>(device, batch, |_| clear.run()).0)
                .unwrap_or_default();
            let (time, issue) = timed_batch(
                device,
                call,
                name,
                inputs,
                i * batch,
                batch,
                options,
                clear.as_mut(),
            );
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
            dtype: args.dtype.unwrap_or(DType::BF16),
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
            dtype: args.dtype.unwrap_or(DType::F32),
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

/// Every requested mode on backend `B` (its `Autodiff` for `fwdbwd`), then the summary.
/// `reserved` reads the bytes the device's memory pools hold.
fn run_modes<B: FlashAttentionBackend>(
    device: B::Device,
    args: &Args,
    s: &Settings,
    reserved: &dyn Fn() -> Option<u64>,
) where
    Autodiff<B>: FlashAttentionBackend<Device = B::Device>,
{
    println!("impl,dtype,b,h,hkv,n,d,causal,mode,ms,tflops");
    println!(
        "# timing: {}",
        match args.timing {
            Timing::Clear => "clear (a 256 MiB pass before each call, as do_bench; --timing)",
            Timing::BackToBack => "b2b (calls back to back; --timing)",
        }
    );
    let mut timed = Vec::new();
    for mode in &args.modes {
        let forward_only: Call<B> = |name, inputs, options| {
            forward(name, inputs, options);
        };
        match mode.as_str() {
            "fwd" => run::<B>(
                device.clone(),
                args,
                s,
                mode,
                forward_only,
                reserved,
                &mut timed,
            ),
            _ => run::<Autodiff<B>>(
                device.clone(),
                args,
                s,
                mode,
                forward_backward,
                reserved,
                &mut timed,
            ),
        }
    }
    let peers = args.peers.as_deref().map(read_peers).unwrap_or_default();
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
fn read_peers(path: &str) -> Vec<Timed> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| fail(&format!("--peers {path}: {e}")));
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
    for ours in timed.iter().filter(|t| t.name == "burn-flash") {
        let mode = ours
            .shape
            .rsplit(',')
            .next()
            .unwrap_or_default()
            .to_string();
        let mut line = format!(
            "# {}: burn-flash {:.4} ms{}",
            ours.shape,
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

/// `--memory`: one training step per length of the first implementation, and the memory the
/// CUDA device's pools hold afterwards.
#[cfg(feature = "cuda")]
fn memory(device: burn::backend::cuda::CudaDevice, args: &Args, s: &Settings) {
    use cubecl::Runtime;
    type B = Autodiff<burn::backend::Cuda>;
    let name = args.impls[0].as_str();
    println!("impl,dtype,b,h,n,d,causal,bytes_reserved,bytes_in_use");
    for &d in &s.d {
        for &n in &s.n {
            for &causal in &args.causal {
                let (b, h) = (args.b.max(1), args.h.max(1));
                let inputs = Set::<B>::random(args, &device, s.dtype, [b, h, h, n, d]);
                let options = FlashAttentionOptions::new().with_causal(causal);
                let row = format!(
                    "{name},{},{b},{h},{n},{d},{}",
                    dtype_name(s.dtype),
                    py_bool(causal)
                );
                let step = catch_unwind(AssertUnwindSafe(|| {
                    forward_backward::<B>(name, inputs, options);
                    <B as burn::tensor::backend::Backend>::sync(&device).expect("device sync");
                }));
                let client = cubecl::cuda::CudaRuntime::client(&device);
                match (step, client.memory_usage()) {
                    (Ok(()), Ok(usage)) => {
                        println!("{row},{},{}", usage.bytes_reserved, usage.bytes_in_use)
                    }
                    (Err(payload), _) => {
                        println!("{row},nan,nan  # error: {}", panic_text(payload))
                    }
                    (Ok(()), Err(e)) => println!("{row},nan,nan  # memory usage: {e:?}"),
                }
            }
        }
    }
}

fn main() {
    let args = parse_args();
    watch_panics();

    #[cfg(feature = "cuda")]
    if args.backend != "wgpu" {
        match burn_flash_suite::cuda_device() {
            Ok(device) => {
                eprintln!("backend: CUDA ({device:?})");
                let s = settings(&args, true);
                if args.memory {
                    memory(device, &args, &s);
                } else {
                    use cubecl::Runtime;
                    let client = cubecl::cuda::CudaRuntime::client(&device);
                    let reserved = move || client.memory_usage().ok().map(|u| u.bytes_reserved);
                    if args.backend == "cuda-bare" {
                        // CubeBackend without the fusion stream: what the stream costs per call.
                        type Bare =
                            burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
                        run_modes::<Bare>(device, &args, &s, &reserved);
                    } else {
                        run_modes::<burn::backend::Cuda>(device, &args, &s, &reserved);
                    }
                }
                return;
            }
            Err(reason) if args.backend.starts_with("cuda") => {
                fail(&format!("no CUDA device: {reason}"))
            }
            Err(reason) => eprintln!("no CUDA device ({reason}); using wgpu"),
        }
    }
    #[cfg(not(feature = "cuda"))]
    if args.backend == "cuda" {
        fail("built without the `cuda` feature: cargo bench --features cuda");
    }
    if args.memory {
        fail("--memory measures a CUDA device");
    }

    let device = WgpuDevice::default();
    eprintln!("backend: wgpu ({device:?}); small shapes by default");
    let s = settings(&args, false);
    let client = <cubecl::wgpu::WgpuRuntime as cubecl::Runtime>::client(&device);
    let reserved = move || client.memory_usage().ok().map(|u| u.bytes_reserved);
    run_modes::<Wgpu>(device, &args, &s, &reserved);
}
