//! The training loop: AdamW with warmup and cosine decay, periodic validation, the loss curve
//! as CSV, a progress bar, and a sample from the trained model.

use std::f64::consts::PI;
use std::fs::File;
use std::io::{self, BufWriter, IsTerminal, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use burn::grad_clipping::GradientClippingConfig;
use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams, MultiGradientsParams};
use burn::tensor::activation::softmax;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_flash::KvCache;
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::data::{Batch, Batches, decode};
use crate::model::Gpt;

/// The first steps compile kernels and autotune; throughput is measured after them.
pub const UNTIMED_STEPS: usize = 10;

/// What a training run does, besides the model.
pub struct Settings {
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per step, over all devices.
    pub batch: usize,
    /// Tokens per sequence.
    pub context: usize,
    /// The dtype the model computes in; its parameters stay in their own (mixed precision).
    pub dtype: DType,
    /// The learning rate of each step.
    pub schedule: Schedule,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f32,
    /// Steps between validations (the last step validates too).
    pub eval_every: usize,
    /// Batches per validation; 0 skips validation (and its kernels' compilation).
    pub eval_batches: usize,
    /// Seed of the batches and of the sample.
    pub seed: u64,
    /// Steps between progress lines when stderr is not a terminal.
    pub log_every: usize,
    /// Where to write the loss curve, if anywhere.
    pub csv: Option<PathBuf>,
    /// The start of the generated sample.
    pub prompt: String,
    /// Bytes generated after the prompt.
    pub sample_len: usize,
}

/// Learning rate: linear warmup from 0 to `peak` over `warmup` steps, then cosine decay to
/// `min` at the last step.
#[derive(Clone, Copy, Debug)]
pub struct Schedule {
    /// The rate at the end of the warmup.
    pub peak: f64,
    /// The rate at the last step.
    pub min: f64,
    /// Steps of linear warmup.
    pub warmup: usize,
    /// All steps, warmup included.
    pub steps: usize,
}

impl Schedule {
    /// The rate of step `step`, counted from 1.
    pub fn at(&self, step: usize) -> f64 {
        if step <= self.warmup {
            return self.peak * step as f64 / self.warmup as f64;
        }
        let decay_steps = self.steps.saturating_sub(self.warmup).max(1);
        let progress = ((step - self.warmup) as f64 / decay_steps as f64).min(1.0);
        self.min + 0.5 * (self.peak - self.min) * (1.0 + (PI * progress).cos())
    }
}

/// What [`train`] measured, and the sample of the trained model.
pub struct Report {
    /// Training loss of the first step.
    pub first_train_loss: f64,
    /// Training loss of the last step.
    pub final_train_loss: f64,
    /// Validation loss before training; NaN when validation is off.
    pub first_val_loss: f64,
    /// Validation loss after the last step; NaN when validation is off.
    pub final_val_loss: f64,
    /// Training tokens per second after the first [`UNTIMED_STEPS`] steps, if there were any.
    pub tokens_per_second: Option<f64>,
    /// Wall time of all training steps, validation excluded.
    pub train_time: Duration,
    /// Largest `bytes_reserved` of a device's memory pools seen after a step (the largest of
    /// the devices, when there are several); `None` where the devices report none.
    pub peak_reserved: Option<u64>,
    /// `prompt` continued by the trained model.
    pub sample: String,
    /// The rate of the sample's generation one byte at a time through key/value caches, if
    /// it produced any so.
    pub generation: Option<GenerationRate>,
}

/// How fast single-byte generation steps ran (sampling on the host included).
#[derive(Clone, Copy, Debug)]
pub struct GenerationRate {
    /// Bytes per second over all the steps, their first kernel compilations included.
    pub tokens_per_second: f64,
    /// The median step, which compilations and autotuning do not move.
    pub median_step: Duration,
}

/// Train `model` on windows of `train_text`, validating on `val_text`, on `devices` (autodiff
/// devices; with several, data-parallel: each takes an equal share of every batch), then
/// generate the sample. Fails only on writing the CSV.
pub fn train(
    mut model: Gpt,
    train_text: &[u8],
    val_text: &[u8],
    settings: &Settings,
    devices: &[Device],
) -> io::Result<Report> {
    let s = settings;
    // Validation and sampling run on the first device, without autodiff.
    let eval_device = devices[0].clone().without_autodiff();
    let mut optimizer = AdamWConfig::new()
        .with_weight_decay(s.weight_decay)
        .with_grad_clipping(Some(GradientClippingConfig::Norm(1.0)))
        .init();
    let mut batches = Batches::new(train_text, s.batch, s.context, s.seed);
    // A fixed validation set, so that validation losses compare across steps.
    let mut val_draw = Batches::new(val_text, s.batch, s.context, s.seed.wrapping_add(1));
    let val_batches: Vec<Batch> = (0..s.eval_batches).map(|_| val_draw.next_batch()).collect();

    let mut csv = match &s.csv {
        Some(path) => {
            let mut file = BufWriter::new(File::create(path)?);
            writeln!(file, "step,lr,train_loss,val_loss")?;
            Some(file)
        }
        None => None,
    };
    let reserved_bytes = || {
        devices
            .iter()
            .filter_map(|device| device.memory_pool_usage())
            .map(|usage| usage.bytes_reserved)
            .max()
    };
    let progress = Progress::new(s.steps, s.log_every);
    let (mut timed, mut timed_tokens, mut train_time) = (Duration::ZERO, 0usize, Duration::ZERO);
    let mut peak_reserved = reserved_bytes();
    let (mut first_train_loss, mut train_loss) = (f64::NAN, f64::NAN);
    // After a step on several devices each parameter lives where its gradients were summed.
    let gathered = |model: &Gpt| model.valid().to_device(&eval_device).cast(s.dtype);
    let first_val_loss = evaluate(&gathered(&model), &val_batches, &eval_device);
    let mut val_loss = first_val_loss;

    for step in 1..=s.steps {
        let lr = s.schedule.at(step);
        let batch = batches.next_batch();
        let start = Instant::now();
        if let [device] = devices {
            let (inputs, targets) = batch_tensors(&batch, device);
            let loss = model.cast(s.dtype).loss(inputs, targets);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(lr, model, grads);
            train_loss = loss.into_scalar::<f64>();
        } else {
            let grads;
            (grads, train_loss) = data_parallel_grads(&model, s.dtype, &batch, devices);
            model = optimizer.step_multi(lr, model, grads);
        }
        for device in devices {
            device.sync().expect("device sync");
        }
        let elapsed = start.elapsed();
        train_time += elapsed;
        if step > UNTIMED_STEPS {
            timed += elapsed;
            timed_tokens += s.batch * s.context;
        }
        if step == 1 {
            first_train_loss = train_loss;
        }
        peak_reserved = peak_reserved.max(reserved_bytes());

        let evaluated =
            !val_batches.is_empty() && (step.is_multiple_of(s.eval_every) || step == s.steps);
        if evaluated {
            val_loss = evaluate(&gathered(&model), &val_batches, &eval_device);
        }
        if let Some(file) = csv.as_mut() {
            let val = if evaluated {
                val_loss.to_string()
            } else {
                String::new()
            };
            writeln!(file, "{step},{lr},{train_loss},{val}")?;
            // Flushed per line, so that a run cut short still leaves its curve so far.
            file.flush()?;
        }
        let tokens_per_second =
            (timed_tokens > 0).then(|| timed_tokens as f64 / timed.as_secs_f64());
        progress.update(step, lr, train_loss, val_loss, tokens_per_second);
    }
    progress.finish();

    let (sample, generation) = generate(
        &gathered(&model),
        &s.prompt,
        s.sample_len,
        s.seed,
        &eval_device,
    );
    Ok(Report {
        first_train_loss,
        final_train_loss: train_loss,
        first_val_loss,
        final_val_loss: val_loss,
        tokens_per_second: (timed_tokens > 0).then(|| timed_tokens as f64 / timed.as_secs_f64()),
        train_time,
        peak_reserved,
        sample,
        generation,
    })
}

/// One data-parallel step's gradients and mean loss, the way burn-train's multi-device learner
/// takes it: the model forked onto each device (a fork has its own autodiff graph), each device's
/// share of the batch forward and backward on a thread of its own, and the gradients returned
/// per device for the optimizer's `step_multi`, which sums each parameter's gradients on one
/// device (chosen by parameter id, the same every step) and updates the parameter there.
fn data_parallel_grads(
    model: &Gpt,
    dtype: DType,
    batch: &Batch,
    devices: &[Device],
) -> (MultiGradientsParams, f64) {
    let parts = devices.len();
    // Forked here, one device after another: a fork copies parameters between devices, and
    // CubeCL pairs each copy's send and receive on the two devices' queues in submission order.
    let replicas: Vec<Gpt> = devices.iter().map(|d| model.clone().fork(d)).collect();
    let outputs: Vec<(GradientsParams, f64)> = std::thread::scope(|scope| {
        let workers: Vec<_> = replicas
            .into_iter()
            .zip(batch.shards(parts))
            .zip(devices)
            .map(|((replica, shard), device)| {
                scope.spawn(move || {
                    let (inputs, targets) = batch_tensors(&shard, device);
                    let loss = replica.cast(dtype).loss(inputs, targets);
                    // The whole batch's mean is the mean of the shards' means, so each shard's
                    // gradients are scaled by 1/parts before the optimizer sums them.
                    let grads = loss.clone().div_scalar(parts as f64).backward();
                    let grads = GradientsParams::from_grads(grads, &replica);
                    (grads, loss.into_scalar::<f64>())
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|worker| worker.join().expect("a training thread panicked"))
            .collect()
    });
    let loss = outputs.iter().map(|(_, loss)| loss).sum::<f64>() / parts as f64;
    let grads = outputs
        .into_iter()
        .zip(devices)
        .map(|((grads, _), device)| (grads, device.clone()))
        .collect();
    (MultiGradientsParams { grads }, loss)
}

fn batch_tensors(batch: &Batch, device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let shape = [batch.batch, batch.context];
    let tensor = |tokens: &[i32]| {
        Tensor::<2, Int>::from_data(TensorData::new(tokens.to_vec(), shape), device)
    };
    (tensor(&batch.inputs), tensor(&batch.targets))
}

/// Mean loss over the batches (NaN for none).
fn evaluate(model: &Gpt, batches: &[Batch], device: &Device) -> f64 {
    let total: f64 = batches
        .iter()
        .map(|batch| {
            let (inputs, targets) = batch_tensors(batch, device);
            model.loss(inputs, targets).into_scalar::<f64>()
        })
        .sum();
    total / batches.len() as f64
}

/// `prompt` continued by `len` bytes, each sampled from the model's softmax (temperature 1),
/// through key/value caches: the window (the prompt's end, left-padded with newlines to half
/// the context) is run once, then each new byte alone at the next position; when the positions
/// run out, the last half context is run again into emptied caches. Returns the text and the
/// rate of the single-byte steps (sampling on the host included).
fn generate(
    model: &Gpt,
    prompt: &str,
    len: usize,
    seed: u64,
    device: &Device,
) -> (String, Option<GenerationRate>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut tokens: Vec<i32> = prompt.bytes().map(i32::from).collect();
    let context = model.context();
    let window = (context / 2).max(1);
    let mut caches = model.caches(1, device);
    let mut position = 0;
    let mut primed = false;
    let mut steps = Vec::new();
    for _ in 0..len {
        let started = Instant::now();
        let single = primed && position < context;
        let next = if single {
            // The last sampled byte at the next position.
            let last = &tokens[tokens.len() - 1..];
            let input = Tensor::<2, Int>::from_data(TensorData::new(last.to_vec(), [1, 1]), device);
            let out = model.forward_cached(input, position, &mut caches);
            position += 1;
            out
        } else {
            // The window: always as long, so that its kernels compile once.
            let recent = &tokens[tokens.len().saturating_sub(window)..];
            let mut padded = vec![i32::from(b'\n'); window - recent.len()];
            padded.extend_from_slice(recent);
            caches.iter_mut().for_each(KvCache::clear);
            let input = Tensor::<2, Int>::from_data(TensorData::new(padded, [1, window]), device);
            position = window;
            model.forward_cached(input, 0, &mut caches)
        };
        let next = next.expect("the caches hold the context");
        let [_, seq, vocab] = next.dims();
        let last = next.slice([0..1, seq - 1..seq, 0..vocab]).reshape([vocab]);
        let probs = softmax(last, 0)
            .into_data()
            .try_into_vec_as::<f32>()
            .expect("probabilities as f32");
        primed = true;
        let mut u = rng.random::<f32>();
        let token = probs
            .iter()
            .position(|&p| {
                u -= p;
                u < 0.0
            })
            .unwrap_or(vocab - 1);
        tokens.push(token as i32);
        if single {
            steps.push(started.elapsed());
        }
    }
    let bytes: Vec<u8> = tokens.iter().map(|&t| t as u8).collect();
    let rate = (!steps.is_empty()).then(|| {
        let total: Duration = steps.iter().sum();
        steps.sort();
        GenerationRate {
            tokens_per_second: steps.len() as f64 / total.as_secs_f64(),
            median_step: steps[steps.len() / 2],
        }
    });
    (decode(&bytes), rate)
}

/// Progress on stderr: an indicatif bar redrawn in place on a terminal; otherwise (logs of CI
/// or `nohup`) the bar is hidden and a plain line is printed every `log_every` steps.
struct Progress {
    bar: ProgressBar,
    steps: usize,
    log_every: usize,
    terminal: bool,
    start: Instant,
}

/// Width of the plain lines' bar, in steps of `steps / WIDTH`.
const WIDTH: usize = 24;

impl Progress {
    fn new(steps: usize, log_every: usize) -> Self {
        let terminal = io::stderr().is_terminal();
        let bar = if terminal {
            ProgressBar::new(steps as u64)
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template(&format!(
                "[{{bar:{WIDTH}}}] step {{pos}}/{{len}} | {{msg}} | {{elapsed}}"
            ))
            .expect("a valid template")
            .progress_chars("#>."),
        );
        Self {
            bar,
            steps,
            log_every: log_every.max(1),
            terminal,
            start: Instant::now(),
        }
    }

    fn update(&self, step: usize, lr: f64, train: f64, val: f64, tokens_per_second: Option<f64>) {
        let speed = tokens_per_second.map_or("-".into(), |t| format!("{t:.0}"));
        let status =
            format!("lr {lr:.2e} | train loss {train:.4} | val loss {val:.4} | {speed} tokens/s");
        if !self.terminal && (step.is_multiple_of(self.log_every) || step == self.steps) {
            let done = WIDTH * step / self.steps;
            let bar = format!("{}{}", "#".repeat(done), ".".repeat(WIDTH - done));
            eprintln!(
                "[{bar}] step {step}/{} | {status} | {:.0} s",
                self.steps,
                self.start.elapsed().as_secs_f64()
            );
        }
        self.bar.set_message(status);
        self.bar.set_position(step as u64);
    }

    fn finish(&self) {
        // Leaves the last state on the terminal.
        self.bar.finish();
    }
}

#[cfg(test)]
mod tests {
    use burn::module::{ModuleVisitor, Param};
    use burn::optim::SgdConfig;

    use super::*;
    use crate::model::GptConfig;

    /// Every float parameter of a module, flattened.
    struct Flatten(Vec<f32>);

    impl ModuleVisitor for Flatten {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let values = param.val().into_data().try_into_vec_as::<f32>();
            self.0.extend(values.expect("f32 values"));
        }
    }

    fn flatten<M: Module>(module: &M) -> Vec<f32> {
        let mut flat = Flatten(Vec::new());
        module.visit(&mut flat);
        flat.0
    }

    /// Plain SGD (its step is the gradient times the rate, so a mis-scaled gradient shows) on
    /// two "devices" (the one lavapipe device, twice: the shards, the scaling and Burn's sum of
    /// the per-device gradients are what is checked) against one step on the whole batch.
    #[test]
    fn data_parallel_step_is_the_whole_batch_step() {
        let device = Device::wgpu(Default::default()).autodiff();
        let model = GptConfig::new(256, 16, 1, 32, 2).init(&device);
        let text: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        let batch = Batches::new(&text, 4, 16, 5).next_batch();
        let start = flatten(&model);

        let mut sgd = SgdConfig::new().init();
        let (inputs, targets) = batch_tensors(&batch, &device);
        let loss = model.loss(inputs, targets);
        let whole_loss = loss.clone().into_scalar::<f64>();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let whole = flatten(&sgd.step(0.5, model.clone(), grads));

        // One shard's step first, on this thread: it autotunes the shard's shapes, which the
        // two threads below would otherwise tune at once on the one device, where Burn
        // 0.23.0-pre.1's autotune has hung (on lavapipe, in `Tuner::tune_fixed_samples`).
        let (inputs, targets) = batch_tensors(&batch.shards(2)[0], &device);
        let _tuned = model.clone().loss(inputs, targets).backward();

        let mut sgd = SgdConfig::new().init();
        let devices = [device.clone(), device];
        let (grads, parallel_loss) = data_parallel_grads(&model, DType::F32, &batch, &devices);
        let parallel = flatten(&sgd.step_multi(0.5, model, grads));

        assert!(
            (whole_loss - parallel_loss).abs() < 1e-5,
            "{whole_loss} vs {parallel_loss}"
        );
        let moved: f32 = whole.iter().zip(&start).map(|(a, b)| (a - b).abs()).sum();
        let apart: f32 = whole
            .iter()
            .zip(&parallel)
            .map(|(a, b)| (a - b).abs())
            .sum();
        assert!(
            moved > 1e-2,
            "the step moved the parameters by {moved} in all"
        );
        assert!(
            apart < 1e-4 * moved,
            "parallel step {apart} away; the step moved {moved}"
        );
    }

    #[test]
    fn schedule_warms_up_then_decays_to_the_minimum() {
        let schedule = Schedule {
            peak: 1e-3,
            min: 1e-4,
            warmup: 10,
            steps: 110,
        };
        assert!((schedule.at(1) - 1e-4).abs() < 1e-12);
        assert!((schedule.at(10) - 1e-3).abs() < 1e-12);
        // Halfway through the decay, the cosine is at the midpoint.
        assert!((schedule.at(60) - 5.5e-4).abs() < 1e-12);
        assert!((schedule.at(110) - 1e-4).abs() < 1e-12);
        let rates: Vec<f64> = (10..=110).map(|step| schedule.at(step)).collect();
        assert!(rates.windows(2).all(|w| w[1] < w[0]));
    }
}
