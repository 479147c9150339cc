//! What the benchmarks share: the implementations they time, the device they run on, and the
//! timing of a batch of calls with or without an L2-clearing pass before each.

use std::time::{Duration, Instant};

use burn::tensor::{Device, Int, Tensor};
use clap::ValueEnum;

/// An implementation of attention, named in the CSV as on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum)]
pub enum Impl {
    #[value(name = "burn-flash")]
    Flash,
    #[value(name = "burn-unfused")]
    Unfused,
    #[value(name = "burn-builtin")]
    Builtin,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    Auto,
    Cuda,
    Wgpu,
}

/// A command-line value's name, as `--help` lists it.
pub fn name(value: impl ValueEnum) -> String {
    value
        .to_possible_value()
        .expect("no value is skipped")
        .get_name()
        .to_owned()
}

/// The device `backend` asks for, and whether it is CUDA: `Auto` takes the first CUDA device
/// where the build has CUDA and the machine a device, else wgpu. `Err` says why `Cuda` cannot
/// be had.
pub fn select_device(backend: Backend) -> Result<(Device, bool), &'static str> {
    #[cfg(feature = "cuda")]
    if backend != Backend::Wgpu {
        match Device::enumerate(burn::tensor::DeviceType::Cuda).first() {
            Some(device) => {
                eprintln!("backend: CUDA ({device:?})");
                return Ok((device.clone(), true));
            }
            None if backend == Backend::Cuda => {
                return Err("no CUDA device (no driver, or no GPU)");
            }
            None => eprintln!("no CUDA device; using wgpu"),
        }
    }
    #[cfg(not(feature = "cuda"))]
    if backend == Backend::Cuda {
        return Err("built without the `cuda` feature: cargo bench --features cuda");
    }
    let device = Device::wgpu(Default::default());
    eprintln!("backend: wgpu ({device:?}); small shapes by default");
    Ok((device, false))
}

/// How a clearing pass leaves the L2 cache before each timed call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ClearKind {
    /// 128 MiB of `i32` reversed (read and written: 256 MiB moved, more than the L2 cache of any
    /// card holds), as PyTorch's `do_bench` zeroes 256 MB: the cache is left full of written
    /// lines, which the timed call's own reads write back to memory as they evict them.
    Write,
    /// 1 GiB of `f32` summed (read only): the cache is left cold and clean, as in a model,
    /// where the layers before attention mostly read their weights. A quarter of that would
    /// evict the cache as well; the pass is long (~0.25 ms on an H200) so that a call's host
    /// work, enqueued while it runs, stays out of the call's timing window: on a slow host the
    /// 256 MiB pass (60 µs) let 22–41 µs of launches a call into short decoding rows.
    Read,
}

/// The buffer a clearing pass goes over before each call ([`ClearKind`]). A reversal is a
/// gather, which Burn's fusion does not merge into the next reversal, so each clear runs as a
/// kernel of its own; a sum is added into the previous sums, so none is left unused.
// One per process: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum Clear {
    /// The reversed buffer.
    Write(Tensor<1, Int>),
    /// The summed buffer and the sums so far.
    Read { buffer: Tensor<1>, sums: Tensor<1> },
}

impl Clear {
    pub fn new(device: &Device, kind: ClearKind) -> Self {
        match kind {
            ClearKind::Write => Self::Write(Tensor::zeros([32 << 20], device)),
            ClearKind::Read => Self::Read {
                buffer: Tensor::zeros([256 << 20], device),
                sums: Tensor::zeros([1], device),
            },
        }
    }

    pub fn run(&mut self) {
        match self {
            Self::Write(buffer) => *buffer = buffer.clone().flip([0]),
            Self::Read { buffer, sums } => *sums = sums.clone() + buffer.clone().sum(),
        }
    }
}

/// `batch` steps issued back to back, synchronised once at the end: the wall time per step,
/// and the host's time per step to issue them (the device is starved when the two are close).
pub fn timed(device: &Device, batch: usize, mut step: impl FnMut(usize)) -> (Duration, Duration) {
    device.sync().expect("device sync");
    let start = Instant::now();
    for i in 0..batch {
        step(i);
    }
    let issued = start.elapsed();
    device.sync().expect("device sync");
    (start.elapsed() / batch as u32, issued / batch as u32)
}

/// The median of `times`, in milliseconds.
pub fn median_ms(times: &mut [Duration]) -> f64 {
    times.sort_unstable();
    let mid = times.len() / 2;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    if times.len() % 2 == 1 {
        ms(times[mid])
    } else {
        (ms(times[mid - 1]) + ms(times[mid])) / 2.0
    }
}
