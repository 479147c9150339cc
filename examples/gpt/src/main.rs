//! Train a small decoder-only GPT on a byte-level text corpus, with its attention switchable
//! between burn-flash's fused kernel, Burn's `attention` and Burn's unfused `attention_fallback`
//! (`--attention flash|burn|unfused`). See `docs/gpt.md`; `--help` lists the flags.
//!
//! ```text
//! cargo run --release --features cuda -p gpt -- --csv target/gpt-loss.csv
//! ```
//!
//! Runs on CUDA when built with the `cuda` feature and a device answers, otherwise on
//! `burn::backend::Wgpu`. Prints the loss while it trains, then a sample of generated text and a
//! summary line: tokens/s, peak device memory, first and final train and validation losses.

use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr;

use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Autodiff, Wgpu};
use burn::tensor::{DType, Distribution, Tensor};
use burn_flash::nn::AttentionKernel;
use burn_flash::{FlashAttentionBackend, FlashAttentionOptions, flash_attention_plan};
use cubecl::Runtime;

use gpt::data;
use gpt::model::GptConfig;
use gpt::train::{self, Schedule, Settings};

/// The default corpus, shipped in the binary: Ambrose Bierce's _The Devil's Dictionary_ (1911,
/// public domain; `data/README.md`), 383 KB.
const DEFAULT_CORPUS: &[u8] = include_bytes!("../data/devils-dictionary.txt");
const DEFAULT_NAME: &str = "The Devil's Dictionary (built in)";

const USAGE: &str = "\
usage: gpt [flags]

data:
  --data PATH          text file, or directory of text files  [The Devil's Dictionary]
  --val-fraction F     share of the corpus held out for validation          [0.1]
model:
  --layers N  --d-model N  --heads N                                   [2, 64, 4]
  --context N          tokens (bytes) per sequence                           [64]
  --dropout P                                                                [0]
  --attention K        flash | burn | unfused                             [flash]
training:
  --batch N  --steps N                                                 [8, 100]
  --lr LR  --min-lr LR  --warmup N   warmup, then cosine decay      [3e-3, 3e-4, 10]
  --weight-decay W                                                         [0.1]
  --eval-every N  --eval-batches N    (0 batches: no validation)      [20, 4]
  --seed N                                                                  [42]
  --log-every N        progress lines when stderr is not a terminal         [10]
runtime:
  --device D           auto | cuda | wgpu (auto: CUDA if built with `cuda` and present)
  --dtype T            f32 | bf16 | f16 compute; weights stay f32          [f32]
  --devices N          data-parallel over CUDA devices 0..N, batch split evenly [1]
output:
  --csv PATH           loss curve: step,lr,train_loss,val_loss
  --prompt TEXT  --sample-len N    text generated after training         [\"\", 200]
";

struct Args {
    /// The corpus's file or directory; the built-in one when `None`.
    data: Option<PathBuf>,
    val_fraction: f64,
    layers: usize,
    d_model: usize,
    heads: usize,
    context: usize,
    dropout: f64,
    attention: AttentionKernel,
    device: String,
    devices: usize,
    dtype: DType,
    settings: Settings,
}

fn parse_args() -> Result<Option<Args>, String> {
    let mut args = Args {
        data: None,
        val_fraction: 0.1,
        layers: 2,
        d_model: 64,
        heads: 4,
        context: 64,
        dropout: 0.0,
        attention: AttentionKernel::Flash,
        device: "auto".into(),
        devices: 1,
        dtype: DType::F32,
        settings: Settings {
            steps: 100,
            batch: 8,
            context: 64,
            dtype: DType::F32,
            schedule: Schedule {
                peak: 3e-3,
                min: 3e-4,
                warmup: 10,
                steps: 100,
            },
            weight_decay: 0.1,
            eval_every: 20,
            eval_batches: 4,
            seed: 42,
            log_every: 10,
            csv: None,
            prompt: String::new(),
            sample_len: 200,
        },
    };
    let mut raw = std::env::args().skip(1);
    while let Some(flag) = raw.next() {
        if flag == "--help" || flag == "-h" {
            return Ok(None);
        }
        let (flag, value) = match flag.split_once('=') {
            Some((flag, value)) => (flag.to_string(), value.to_string()),
            None => {
                let value = raw.next().ok_or_else(|| format!("{flag} needs a value"))?;
                (flag, value)
            }
        };
        let s = &mut args.settings;
        match flag.as_str() {
            "--data" => args.data = Some(value.into()),
            "--val-fraction" => args.val_fraction = number(&flag, &value)?,
            "--layers" => args.layers = number(&flag, &value)?,
            "--d-model" => args.d_model = number(&flag, &value)?,
            "--heads" => args.heads = number(&flag, &value)?,
            "--context" => args.context = number(&flag, &value)?,
            "--dropout" => args.dropout = number(&flag, &value)?,
            "--attention" => {
                args.attention = match value.as_str() {
                    "flash" => AttentionKernel::Flash,
                    "burn" => AttentionKernel::BurnBuiltin,
                    "unfused" => AttentionKernel::Unfused,
                    _ => return Err(format!("--attention: flash, burn or unfused, not {value}")),
                }
            }
            "--device" if ["auto", "cuda", "wgpu"].contains(&value.as_str()) => args.device = value,
            "--devices" => args.devices = number(&flag, &value)?,
            "--dtype" => {
                args.dtype = match value.as_str() {
                    "f32" => DType::F32,
                    "bf16" => DType::BF16,
                    "f16" => DType::F16,
                    _ => return Err(format!("--dtype: f32, bf16 or f16, not {value}")),
                }
            }
            "--batch" => s.batch = number(&flag, &value)?,
            "--steps" => s.steps = number(&flag, &value)?,
            "--lr" => s.schedule.peak = number(&flag, &value)?,
            "--min-lr" => s.schedule.min = number(&flag, &value)?,
            "--warmup" => s.schedule.warmup = number(&flag, &value)?,
            "--weight-decay" => s.weight_decay = number(&flag, &value)?,
            "--eval-every" => s.eval_every = number(&flag, &value)?,
            "--eval-batches" => s.eval_batches = number(&flag, &value)?,
            "--seed" => s.seed = number(&flag, &value)?,
            "--log-every" => s.log_every = number(&flag, &value)?,
            "--csv" => s.csv = Some(value.into()),
            "--prompt" => s.prompt = value,
            "--sample-len" => s.sample_len = number(&flag, &value)?,
            _ => return Err(format!("unknown flag or value: {flag} {value}")),
        }
    }
    let s = &mut args.settings;
    s.context = args.context;
    s.dtype = args.dtype;
    s.schedule.steps = s.steps;
    if s.steps == 0 || s.batch == 0 || s.eval_every == 0 {
        return Err("--steps, --batch and --eval-every must be positive".into());
    }
    if args.devices == 0 || !s.batch.is_multiple_of(args.devices) {
        return Err("--devices must be positive and divide --batch".into());
    }
    if !(0.0..1.0).contains(&args.val_fraction) || args.val_fraction == 0.0 {
        return Err("--val-fraction must be in (0, 1)".into());
    }
    Ok(Some(args))
}

fn number<T: FromStr>(flag: &str, value: &str) -> Result<T, String> {
    value
        .parse()
        .map_err(|_| format!("{flag}: cannot read {value:?}"))
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(Some(args)) => args,
        Ok(None) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("error: {message}\n\n{USAGE}");
            return ExitCode::FAILURE;
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// CubeCL 0.10 gives each thread its own stream on a device, with its own memory pool, and
/// training on several GPUs it lost track of tensors that came from another device
/// ("Memory page 0 doesn't exist", then failed allocations within a dozen steps on two H100s;
/// `docs/gpt.md`). With one stream per device every tensor of a device lives in one pool, and
/// the same run trains. Set before CubeCL reads its configuration, which is otherwise taken as
/// CubeCL would (`cubecl.toml` or `burn.toml` upwards from the working directory, then the
/// environment).
#[cfg(feature = "cuda")]
fn one_stream_per_device() {
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    config.streaming.max_streams = 1;
    CubeClRuntimeConfig::set(config);
}

fn run(args: &Args) -> Result<(), String> {
    #[cfg(feature = "cuda")]
    if args.device != "wgpu" {
        if args.devices > 1 {
            one_stream_per_device();
        }
        match burn_flash_suite::cuda_device() {
            Ok(device) => {
                use burn::backend::cuda::CudaDevice;
                let count = cubecl::cuda::CudaRuntime::client(&device).device_count_total();
                if args.devices > count {
                    return Err(format!("--devices {}: {count} CUDA devices", args.devices));
                }
                let devices: Vec<CudaDevice> = (0..args.devices).map(CudaDevice::new).collect();
                let clients: Vec<_> = devices
                    .iter()
                    .map(cubecl::cuda::CudaRuntime::client)
                    .collect();
                let reserved = move || {
                    let usage = clients.iter().map(|c| c.memory_usage().ok());
                    usage.map(|u| u.map(|u| u.bytes_reserved)).max().flatten()
                };
                return train_on::<Autodiff<burn::backend::Cuda>>(
                    args, &devices, "CUDA", &reserved,
                );
            }
            Err(reason) if args.device == "cuda" => {
                return Err(format!("no CUDA device: {reason}"));
            }
            Err(reason) => eprintln!("no CUDA device ({reason}); running on wgpu"),
        }
    }
    #[cfg(not(feature = "cuda"))]
    if args.device == "cuda" {
        return Err("--device cuda needs a build with `--features cuda`".into());
    }
    if args.devices > 1 {
        return Err("--devices above 1 needs CUDA".into());
    }
    let device = WgpuDevice::default();
    let client = cubecl::wgpu::WgpuRuntime::client(&device);
    let reserved = move || client.memory_usage().ok().map(|u| u.bytes_reserved);
    train_on::<Autodiff<Wgpu>>(args, &[device], "wgpu", &reserved)
}

fn train_on<B>(
    args: &Args,
    devices: &[B::Device],
    name: &str,
    reserved_bytes: &dyn Fn() -> Option<u64>,
) -> Result<(), String>
where
    B: burn::tensor::backend::AutodiffBackend + FlashAttentionBackend,
    B::InnerBackend: FlashAttentionBackend,
{
    let (corpus, corpus_name) = match &args.data {
        Some(path) => {
            let corpus = data::load_corpus(path)
                .map_err(|e| format!("cannot read the corpus {}: {e}", path.display()))?;
            (corpus, path.display().to_string())
        }
        None => (DEFAULT_CORPUS.to_vec(), DEFAULT_NAME.to_string()),
    };
    let (train_text, val_text) = data::split(&corpus, args.val_fraction);
    if val_text.len() <= args.context {
        return Err(format!(
            "the validation text ({} bytes) must be longer than the context ({})",
            val_text.len(),
            args.context
        ));
    }
    println!(
        "data:      {} ({} bytes: {} train, {} validation)",
        corpus_name,
        corpus.len(),
        train_text.len(),
        val_text.len()
    );

    let device = &devices[0];
    B::seed(device, args.settings.seed);
    let model = GptConfig::new(
        data::VOCAB_SIZE,
        args.context,
        args.layers,
        args.d_model,
        args.heads,
    )
    .with_dropout(args.dropout)
    .with_kernel(args.attention)
    .init::<B>(device);
    let parameters = burn::module::Module::num_params(&model);
    println!(
        "model:     {} layers, d_model {}, {} heads, context {}, {parameters} parameters, {:?} \
         weights computing in {:?}",
        args.layers,
        args.d_model,
        args.heads,
        args.context,
        model.dtype(),
        args.dtype
    );
    let d_k = args.d_model / args.heads;
    let probe = Tensor::<B, 4>::random(
        [args.settings.batch, args.heads, args.context, d_k],
        Distribution::Default,
        (device, args.dtype),
    );
    let plan = flash_attention_plan(&probe, &probe, &probe, FlashAttentionOptions::causal())
        .map_or_else(|e| format!("refused: {e}"), |plan| plan.to_string());
    println!(
        "attention: {:?} (burn-flash would run: {plan})",
        args.attention
    );
    println!("device:    {name} {devices:?}");

    let s = &args.settings;
    let report = train::train(model, &train_text, &val_text, s, devices, reserved_bytes)
        .map_err(|e| format!("writing the loss curve: {e}"))?;

    println!("\nsample:\n{}\n", report.sample);
    println!(
        "summary: {name} x{} {:?} attention {:?} | {} steps x {} tokens in {:.1} s | {} tokens/s (steps {}..) | \
         peak reserved {} per device | train loss {:.4} -> {:.4} | val loss {:.4} -> {:.4}",
        devices.len(),
        args.dtype,
        args.attention,
        s.steps,
        s.batch * s.context,
        report.train_time.as_secs_f64(),
        report
            .tokens_per_second
            .map_or("-".into(), |t| format!("{t:.0}")),
        train::UNTIMED_STEPS + 1,
        report.peak_reserved.map_or("-".into(), |b| format!(
            "{:.1} MiB",
            b as f64 / (1 << 20) as f64
        )),
        report.first_train_loss,
        report.final_train_loss,
        report.first_val_loss,
        report.final_val_loss,
    );
    Ok(())
}
