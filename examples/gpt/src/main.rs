//! Train a small decoder-only GPT on a byte-level text corpus, with its attention switchable
//! between burn-flash's fused kernel, Burn's `attention` and Burn's unfused `attention_fallback`
//! (`--attention flash|burn|unfused|unfused-f32`). See `docs/gpt.md`; `--help` lists the flags.
//!
//! ```text
//! cargo run --release --features cuda -p gpt -- --csv target/gpt-loss.csv
//! ```
//!
//! Runs on CUDA when built with the `cuda` feature and a device answers, otherwise on
//! `Device::wgpu`. Prints the loss while it trains, then a sample of generated text and a
//! summary line: tokens/s, peak device memory, first and final train and validation losses.

use std::path::PathBuf;
use std::process::ExitCode;

use burn::module::Module;
use burn::tensor::{DType, Device, Distribution, Tensor};
use burn_flash::nn::AttentionKernel;
use burn_flash::{FlashAttentionOptions, flash_attention_plan};
use clap::builder::RangedU64ValueParser;
use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, ValueEnum};

use gpt::data;
use gpt::model::GptConfig;
use gpt::train::{self, Schedule, Settings};

/// The default corpus, shipped in the binary: Ambrose Bierce's _The Devil's Dictionary_ (1911,
/// public domain; `data/README.md`), 383 KB.
const DEFAULT_CORPUS: &[u8] = include_bytes!("../data/devils-dictionary.txt");
const DEFAULT_NAME: &str = "The Devil's Dictionary (built in)";

/// Train a small GPT on a byte-level text corpus, its attention computed by burn-flash's fused
/// kernel or by Burn's (docs/gpt.md).
#[derive(Parser, Debug)]
#[command(name = "gpt", bin_name = "gpt")]
struct Args {
    /// Text file, or directory of text files [default: The Devil's Dictionary, built in].
    #[arg(long, value_name = "PATH", help_heading = "Data")]
    data: Option<PathBuf>,
    /// Share of the corpus held out for validation, in (0, 1).
    #[arg(long, value_name = "F", default_value_t = 0.1, value_parser = fraction, help_heading = "Data")]
    val_fraction: f64,

    /// Blocks.
    #[arg(long, value_name = "N", default_value_t = 2, help_heading = "Model")]
    layers: usize,
    /// Width of the residual stream.
    #[arg(long, value_name = "N", default_value_t = 64, help_heading = "Model")]
    d_model: usize,
    /// Attention heads (they divide --d-model).
    #[arg(long, value_name = "N", default_value_t = 4, help_heading = "Model")]
    heads: usize,
    /// Tokens (bytes) per sequence.
    #[arg(long, value_name = "N", default_value_t = 64, help_heading = "Model")]
    context: usize,
    /// Dropout of the embeddings, attention probabilities, attention outputs and MLP.
    #[arg(long, value_name = "P", default_value_t = 0.0, help_heading = "Model")]
    dropout: f64,
    /// What computes the attention: burn-flash's kernel, Burn's `attention`, or Burn's
    /// `attention_fallback`.
    #[arg(long, value_enum, default_value_t = Attention::Flash, help_heading = "Model")]
    attention: Attention,

    /// Sequences per step (over all devices).
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = positive(), help_heading = "Training")]
    batch: usize,
    /// Optimizer steps.
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = positive(), help_heading = "Training")]
    steps: usize,
    /// Peak learning rate, after a linear warmup; then cosine decay to --min-lr.
    #[arg(
        long,
        value_name = "LR",
        default_value_t = 3e-3,
        help_heading = "Training"
    )]
    lr: f64,
    /// Learning rate at the last step.
    #[arg(
        long,
        value_name = "LR",
        default_value_t = 3e-4,
        help_heading = "Training"
    )]
    min_lr: f64,
    /// Warmup steps.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 10,
        help_heading = "Training"
    )]
    warmup: usize,
    /// AdamW's weight decay.
    #[arg(
        long,
        value_name = "W",
        default_value_t = 0.1,
        help_heading = "Training"
    )]
    weight_decay: f32,
    /// Steps between validations (and the last step).
    #[arg(long, value_name = "N", default_value_t = 20, value_parser = positive(), help_heading = "Training")]
    eval_every: usize,
    /// Batches per validation; 0: no validation.
    #[arg(long, value_name = "N", default_value_t = 4, help_heading = "Training")]
    eval_batches: usize,
    /// Seed of the data, the initialisation and the sampling.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 42,
        help_heading = "Training"
    )]
    seed: u64,
    /// Steps between progress lines when stderr is not a terminal.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 10,
        help_heading = "Training"
    )]
    log_every: usize,

    /// auto: CUDA if built with `cuda` and a device is present, else wgpu.
    #[arg(long, value_enum, default_value_t = Backend::Auto, help_heading = "Runtime")]
    device: Backend,
    /// The dtype the model computes in; weights and optimizer state stay f32.
    #[arg(long, value_enum, default_value_t = Precision::F32, help_heading = "Runtime")]
    dtype: Precision,
    /// Data-parallel over CUDA devices 0..N, the batch split evenly (N divides --batch).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = positive(), help_heading = "Runtime")]
    devices: usize,

    /// Write the loss curve there: step,lr,train_loss,val_loss.
    #[arg(long, value_name = "PATH", help_heading = "Output")]
    csv: Option<PathBuf>,
    /// Text the generated sample starts with.
    #[arg(long, value_name = "TEXT", default_value = "", help_heading = "Output")]
    prompt: String,
    /// Bytes generated after training.
    #[arg(long, value_name = "N", default_value_t = 200, help_heading = "Output")]
    sample_len: usize,
}

/// `--attention`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Attention {
    Flash,
    Burn,
    Unfused,
    /// The unfused attention computed in f32 whatever `--dtype` says: the reference curve.
    UnfusedF32,
}

impl Attention {
    fn kernel(self) -> AttentionKernel {
        match self {
            Self::Flash => AttentionKernel::Flash,
            Self::Burn => AttentionKernel::BurnBuiltin,
            Self::Unfused => AttentionKernel::Unfused,
            Self::UnfusedF32 => AttentionKernel::UnfusedF32,
        }
    }
}

/// `--device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    Auto,
    Cuda,
    Wgpu,
}

/// `--dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Precision {
    F32,
    Bf16,
    F16,
}

impl Precision {
    fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
        }
    }
}

fn positive() -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(1..)
}

fn fraction(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(f) if f > 0.0 && f < 1.0 => Ok(f),
        _ => Err(format!("{value} is not a fraction in (0, 1)")),
    }
}

impl Args {
    fn settings(&self) -> Settings {
        Settings {
            steps: self.steps,
            batch: self.batch,
            context: self.context,
            dtype: self.dtype.dtype(),
            schedule: Schedule {
                peak: self.lr,
                min: self.min_lr,
                warmup: self.warmup,
                steps: self.steps,
            },
            weight_decay: self.weight_decay,
            eval_every: self.eval_every,
            eval_batches: self.eval_batches,
            seed: self.seed,
            log_every: self.log_every,
            csv: self.csv.clone(),
            prompt: self.prompt.clone(),
            sample_len: self.sample_len,
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !args.batch.is_multiple_of(args.devices) {
        Args::command()
            .error(ErrorKind::ValueValidation, "--devices must divide --batch")
            .exit();
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// CubeCL gives each thread its own stream on a device, with its own memory pool. On CubeCL
/// 0.10, training on several GPUs lost track of tensors that came from another device ("Memory
/// page 0 doesn't exist", then failed allocations within a dozen steps on two H100s;
/// `docs/gpt.md`), and one stream per device, keeping every tensor of a device in one pool,
/// fixed it. CubeCL 0.12 still defaults to a stream per thread, so the setting stays until a
/// multi-GPU run shows it unneeded. Set before CubeCL reads its configuration, which is
/// otherwise taken as CubeCL would (`cubecl.toml` or `burn.toml` upwards from the working
/// directory, then the environment).
#[cfg(feature = "cuda")]
fn one_stream_per_device() {
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    config.streaming.max_streams = 1;
    CubeClRuntimeConfig::set(config);
}

fn run(args: &Args) -> Result<(), String> {
    #[cfg(feature = "cuda")]
    if args.device != Backend::Wgpu {
        if args.devices > 1 {
            one_stream_per_device();
        }
        // Lists none, without panicking, when the driver library cannot be loaded.
        let count = Device::enumerate(burn::tensor::DeviceType::Cuda).len();
        if count > 0 {
            if args.devices > count {
                return Err(format!("--devices {}: {count} CUDA devices", args.devices));
            }
            let devices: Vec<Device> = (0..args.devices)
                .map(|index| Device::cuda(index).autodiff())
                .collect();
            return train_on(args, &devices, "CUDA");
        }
        if args.device == Backend::Cuda {
            return Err("no CUDA device (no driver, or no GPU)".into());
        }
        eprintln!("no CUDA device (no driver, or no GPU); running on wgpu");
    }
    #[cfg(not(feature = "cuda"))]
    if args.device == Backend::Cuda {
        return Err("--device cuda needs a build with `--features cuda`".into());
    }
    if args.devices > 1 {
        return Err("--devices above 1 needs CUDA".into());
    }
    let device = Device::wgpu(Default::default()).autodiff();
    train_on(args, &[device], "wgpu")
}

fn train_on(args: &Args, devices: &[Device], name: &str) -> Result<(), String> {
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
    device.seed(args.seed);
    let dtype = args.dtype.dtype();
    let kernel = args.attention.kernel();
    let model = GptConfig::new(
        data::VOCAB_SIZE,
        args.context,
        args.layers,
        args.d_model,
        args.heads,
    )
    .with_dropout(args.dropout)
    .with_kernel(kernel)
    .init(device);
    println!(
        "model:     {} layers, d_model {}, {} heads, context {}, {} parameters, {:?} \
         weights computing in {dtype:?}",
        args.layers,
        args.d_model,
        args.heads,
        args.context,
        model.num_params(),
        model.dtype(),
    );
    let d_k = args.d_model / args.heads;
    let probe = Tensor::<4>::random(
        [args.batch, args.heads, args.context, d_k],
        Distribution::Default,
        (device, dtype),
    );
    let plan = flash_attention_plan(&probe, &probe, &probe, FlashAttentionOptions::causal())
        .map_or_else(|e| format!("refused: {e}"), |plan| plan.to_string());
    println!("attention: {kernel:?} (burn-flash would run: {plan})");
    // Without the autodiff wrapper, which every training device has.
    let plain: Vec<Device> = devices
        .iter()
        .map(|d| d.clone().without_autodiff())
        .collect();
    println!("device:    {name} {plain:?}");

    let s = args.settings();
    let report = train::train(model, &train_text, &val_text, &s, devices)
        .map_err(|e| format!("writing the loss curve: {e}"))?;

    println!("\nsample:\n{}\n", report.sample);
    if let Some(rate) = report.generation {
        println!(
            "generation: {:.1} tokens/s (median step {:.2} ms), one at a time through key/value caches",
            rate.tokens_per_second,
            rate.median_step.as_secs_f64() * 1e3
        );
    }
    println!(
        "summary: {name} x{} {dtype:?} attention {kernel:?} | {} steps x {} tokens in {:.1} s | {} tokens/s (steps {}..) | \
         peak reserved {} per device | train loss {:.4} -> {:.4} | val loss {:.4} -> {:.4}",
        devices.len(),
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
