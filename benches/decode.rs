//! Decoding against a KV cache: `--sq` new queries (1 by default) of `--hq` heads attend to `sk`
//! cached keys of `hkv` heads (grouped-query attention when `hkv < hq`), causal aligned
//! bottom-right (the KV-cache convention: the new queries are the cache's last positions). CSV
//! on stdout with the columns of `scripts/torch_decode_bench.py`, so both tables can be joined:
//!
//! ```text
//! impl,dtype,b,hq,hkv,sq,sk,d,ms,gbps
//! ```
//!
//! ```text
//! cargo bench --features cuda --bench decode -- --b 1,8,64 --sk 4096,16384,131072 --hkv 32,8,4
//! cargo bench --bench decode -- --help
//! ```
//!
//! `--cache-slack N` draws the keys and values as the first `sk` positions of buffers `N`
//! longer, as a `KvCache`'s filled part, which burn-flash reads in place (stderr counts the
//! views it read so). `--key-lengths` times burn-flash through
//! `try_flash_attention_with_lengths` with every sequence's length given as `sk` (the same
//! bytes as the dense call, through the per-sequence path a cache of different lengths takes;
//! its rows are named `burn-flash-lengths`); `--page-size N` times it through
//! `try_flash_attention_paged` over the same keys in shuffled pages of `N` positions
//! (`burn-flash-paged`).
//!
//! Decoding is bound by memory: GB/s counts the bytes a call cannot avoid moving, the cache's
//! keys and values once per key/value head plus the queries and the output, over the call's
//! time; compare it with the card's bandwidth (4.8 TB/s on an H200, 3.35 on an H100 SXM).
//! On CUDA the inputs are bf16 with head dim 128; elsewhere f32 on `Device::wgpu` with small
//! caches. Shapes whose cache would exceed `--max-cache-gib` are skipped.
//!
//! Method on CUDA, as PyTorch's `do_bench` (and `scripts/torch_decode_bench.py`): before every
//! call a pass over a buffer evicts the L2 cache (a small KV cache would otherwise be read from
//! it), and each call is timed alone on the device, between the events of a Burn profiling
//! window opened after the pass (`device_times`); the median over `--iters` batches of up to
//! 50 calls is reported (`nan` where the device gives no time). On wgpu the
//! calls run back to back without clears (lavapipe is a CPU: its rows are a smoke test). The
//! first call (compilation, autotune) and `--warmup` more are not timed. `burn-builtin` is not
//! a default: Burn 0.23's `attention` autotunes for minutes per new shape on CUDA.
//!
//! `--clear write` (the default) writes the pass, as `do_bench` zeroes its 256 MB (here 128 MiB
//! reversed): the call then finds the L2 cache full of written lines, and its reads write as
//! many back to memory as they evict (up to the cache's size: about 50 MB on an H100 or H200,
//! ~10 µs at 4.8 TB/s).
//! `--clear read` only reads a buffer (a sum of 1 GiB), leaving the cache cold and clean, as in a
//! model, where the layers before attention mostly read their weights; the torch script takes
//! the same flag and the same pass. The pass is long so that the call's host work, enqueued
//! while the pass runs, stays out of the timing window of either program.

mod common;

use std::time::{Duration, Instant};

use burn::tensor::module::{attention, attention_fallback};
use burn::tensor::{
    DType, Device, Distribution, Int, ProfileOptions, Tensor, TensorData, TimingMethod, s,
};
use burn_flash::{
    FlashAttentionOptions, flash_attention, flash_attention_plan, try_flash_attention_paged,
    try_flash_attention_with_lengths,
};
use clap::Parser;
use clap::builder::RangedU64ValueParser;

use common::{Backend, Clear, ClearKind, Impl, median_ms, name, select_device, timed};

/// Decode timings of burn-flash against Burn's attention, as CSV (see the header of
/// `benches/decode.rs`).
#[derive(Parser, Debug)]
#[command(name = "decode", bin_name = "decode")]
struct Args {
    /// Batch sizes [default: 1,8,64 on CUDA, 1,4 on wgpu].
    #[arg(long, value_delimiter = ',')]
    b: Vec<usize>,
    /// Cached keys per sequence [default: 4096,16384,131072 on CUDA, 256,1024 on wgpu].
    #[arg(long, value_delimiter = ',')]
    sk: Vec<usize>,
    /// Key/value heads, each a divisor of --hq [default: 32,8,4 on CUDA (GQA
    /// ratios 1, 4, 8), 8,2 on wgpu].
    #[arg(long, value_delimiter = ',')]
    hkv: Vec<usize>,
    /// Query heads [default: 32 on CUDA, 8 on wgpu].
    #[arg(long)]
    hq: Option<usize>,
    /// New queries per sequence (1: one decoding step; more: a chunk, or speculative tokens to
    /// verify), causal among themselves.
    #[arg(long, default_value_t = 1, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    sq: usize,
    /// Head dim of queries, keys and values [default: 128 on CUDA, 64 on wgpu].
    #[arg(long)]
    d: Option<usize>,
    /// The implementations to time.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "burn-flash,burn-unfused"
    )]
    impls: Vec<Impl>,
    /// The device: auto takes the first CUDA device where the build has CUDA and the machine a
    /// device, else wgpu.
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    backend: Backend,
    /// Timed batches per row (each of as many calls as fill 20 ms, at most 50).
    #[arg(long, default_value_t = 20, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    iters: usize,
    /// Untimed calls after the first.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Skip shapes whose keys and values take more than this.
    #[arg(long, value_name = "GIB", default_value_t = 32.0)]
    max_cache_gib: f64,
    /// Keys and values as the first `sk` positions of buffers this many positions longer, as a
    /// `KvCache`'s filled part (views, read in place by burn-flash); 0: tensors of their own.
    #[arg(long, default_value_t = 0)]
    cache_slack: usize,
    /// burn-flash reads each sequence's key length from a tensor (all `sk`): the path of a
    /// cache whose sequences differ in length.
    #[arg(long)]
    key_lengths: bool,
    /// burn-flash reads the keys and values from shuffled pages of this many positions (a
    /// multiple of 64) through a block table, each sequence's length given as `sk`.
    #[arg(long)]
    page_size: Option<usize>,
    /// The pass before each timed call on CUDA: `write` leaves the L2 cache full of written
    /// lines (as `do_bench`'s zeroing), `read` cold and clean; `scripts/torch_decode_bench.py`
    /// takes the same flag.
    #[arg(long, value_enum, default_value_t = ClearKind::Write)]
    clear: ClearKind,
}

/// How burn-flash finds the cached keys besides the dense call: each sequence's length read
/// from a tensor, and where paged, the keys and values in pages `[pages, page_size, hkv, d]`
/// with their block table.
#[derive(Clone)]
struct Cached {
    lengths: Tensor<1, Int>,
    /// Keys, values and the block table.
    pages: Option<(Tensor<4>, Tensor<4>, Tensor<2, Int>)>,
}

/// One call of `imp`, the causal mask aligned bottom-right; burn-flash reads the keys as
/// `cached` says where given.
fn decode(
    imp: Impl,
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    cached: Option<Cached>,
) -> Tensor<4> {
    let options = FlashAttentionOptions::causal();
    match imp {
        Impl::Flash => match cached {
            Some(Cached {
                lengths,
                pages: Some((k, v, table)),
            }) => try_flash_attention_paged(q, k, v, table, lengths, options)
                .expect("valid decode inputs"),
            Some(Cached { lengths, .. }) => {
                try_flash_attention_with_lengths(q, k, v, lengths, options)
                    .expect("valid decode inputs")
            }
            None => flash_attention(q, k, v, options),
        },
        Impl::Unfused => attention_fallback(q, k, v, None, None, options.into()),
        Impl::Builtin => attention(q, k, v, None, None, options.into()),
    }
}

/// One decode problem.
#[derive(Clone, Copy, Debug)]
struct Shape {
    b: usize,
    hq: usize,
    hkv: usize,
    sq: usize,
    sk: usize,
    d: usize,
}

impl Shape {
    /// Bytes a call must move at `elem` bytes a value: keys and values once per key/value head,
    /// queries read and the output written once.
    fn bytes(&self, elem: usize) -> f64 {
        let cache = 2 * self.b * self.hkv * self.sk * self.d;
        let rows = 2 * self.b * self.hq * self.sq * self.d;
        ((cache + rows) * elem) as f64
    }
}

/// `samples` calls timed on the device, each after a clearing pass, as `do_bench` times them:
/// the pass is handed to the device, then the call runs inside a profiling window (device
/// events, opened and closed by the thread that launches Burn's fused operations, in order with
/// them). The window opens as the pass ends, by when the host has enqueued the call, so the
/// call's host work stays out of it unless it outlasts the pass. Windows are resolved after a
/// sync every 50 calls. `None` where the device has no window (its time would be the host's).
fn device_times(
    device: &Device,
    samples: usize,
    clear: &mut Clear,
    mut call: impl FnMut() + Send,
) -> Option<Vec<Duration>> {
    let mut times = Vec::with_capacity(samples);
    while times.len() < samples {
        let windows: Vec<_> = (0..(samples - times.len()).min(50))
            .map(|_| {
                clear.run();
                device.flush().expect("device flush");
                device
                    .profile_with(ProfileOptions::default().flush(), &mut call)
                    .expect("profiling window")
                    .1
            })
            .collect();
        device.sync().expect("device sync");
        for window in windows {
            if window.timing_method() != TimingMethod::Device {
                return None;
            }
            let ticks = cubecl::future::block_on(window.resolve())?;
            times.push(ticks.duration());
        }
    }
    Some(times)
}

/// The median time of one call of `imp`, in ms: on the device, each call after a clear
/// ([`device_times`]) where there are clears, else back to back. `NaN` where the device gives
/// no time.
fn time_row(
    device: &Device,
    args: &Args,
    imp: Impl,
    inputs: &[Tensor<4>; 3],
    cached: Option<&Cached>,
    clear: Option<&mut Clear>,
) -> f64 {
    let call = || {
        let [q, k, v] = inputs.clone();
        decode(imp, q, k, v, cached.cloned());
    };
    let started = Instant::now();
    call();
    device.sync().expect("device sync");
    let first = started.elapsed();
    for _ in 0..args.warmup {
        call();
    }
    // As many calls as fill about 20 ms back to back, at most 50, times `--iters`.
    let once = timed(device, 1, |_| call()).0;
    let batch = ((0.02 / once.as_secs_f64().max(1e-6)) as usize).clamp(1, 50);
    let launched = burn_flash::testing::forward_launch_time();
    let (ms, issued) = match clear {
        Some(clear) => {
            let times = device_times(device, args.iters * batch, clear, call);
            let ms = times.map_or(f64::NAN, |mut times| median_ms(&mut times));
            (ms, None)
        }
        None => {
            let (mut times, mut issued): (Vec<_>, Vec<_>) = (0..args.iters)
                .map(|_| timed(device, batch, |_| call()))
                .unzip();
            (median_ms(&mut times), Some(median_ms(&mut issued)))
        }
    };
    // burn-flash's own host work per timed call (planning, allocating, enqueueing; under
    // Burn's fusion on the device's thread), 0 for the other implementations.
    let launch = (burn_flash::testing::forward_launch_time() - launched).as_secs_f64() * 1e3
        / (args.iters * batch) as f64;
    // Where a row's time goes: compiles and autotune in the first call, the rest timing; and
    // the host's time to issue a call back to back, which bounds the row where it exceeds the
    // device's.
    let issued = issued.map_or_else(String::new, |ms| {
        format!("the host issued a call in {ms:.4} ms, ")
    });
    eprintln!(
        "  {}: first call {:.1} s, row {:.1} s; {issued}burn-flash's launches took {launch:.4} \
         ms a call; key/value views read in place so far: {}",
        name(imp),
        first.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        burn_flash::testing::views_read_in_place()
    );
    if ms > 0.0 { ms } else { f64::NAN }
}

fn main() {
    // `cargo bench` passes `--bench` to every benchmark program.
    let args = Args::parse_from(std::env::args().filter(|arg| arg != "--bench"));
    let (device, cuda) = select_device(args.backend).unwrap_or_else(|reason| panic!("{reason}"));
    let or = |list: &[usize], cuda_default: &[usize], wgpu_default: &[usize]| match list {
        [] if cuda => cuda_default.to_vec(),
        [] => wgpu_default.to_vec(),
        list => list.to_vec(),
    };
    let batches = or(&args.b, &[1, 8, 64], &[1, 4]);
    let lengths = or(&args.sk, &[4096, 16384, 131072], &[256, 1024]);
    let kv_heads = or(&args.hkv, &[32, 8, 4], &[8, 2]);
    let hq = args.hq.unwrap_or(if cuda { 32 } else { 8 });
    let d = args.d.unwrap_or(if cuda { 128 } else { 64 });
    let (dtype, elem, dtype_name) = if cuda {
        (DType::BF16, 2, "bf16")
    } else {
        (DType::F32, 4, "f32")
    };
    let mut clear = cuda.then(|| Clear::new(&device, args.clear));
    // Half a second of clears before the first row, so that it does not time the memory pool
    // growing under its clears or the clocks rising: the first row of each process ran slower
    // than its neighbours (H200, 2026-11-29: b 1, 32/32 heads, 4k keys at 0.085 ms, slower
    // than the same heads over 16k keys).
    if let Some(clear) = clear.as_mut() {
        let started = Instant::now();
        while started.elapsed() < Duration::from_millis(500) {
            for _ in 0..50 {
                clear.run();
            }
            device.sync().expect("device sync");
        }
    }

    println!("impl,dtype,b,hq,hkv,sq,sk,d,ms,gbps");
    for &hkv in &kv_heads {
        assert!(
            hkv > 0 && hq % hkv == 0,
            "--hkv {hkv} does not divide --hq {hq}"
        );
        for &b in &batches {
            for &sk in &lengths {
                let shape = Shape {
                    b,
                    hq,
                    hkv,
                    sq: args.sq,
                    sk,
                    d,
                };
                // Paged rows hold the cache twice: as the dense peers read it, and in pages.
                let copies = 1 + usize::from(args.page_size.is_some());
                let cache_gib = (copies * 2 * b * hkv * (sk + args.cache_slack) * d * elem) as f64
                    / (1u64 << 30) as f64;
                if cache_gib > args.max_cache_gib {
                    println!("# {shape:?}: cache {cache_gib:.1} GiB over --max-cache-gib, skipped");
                    continue;
                }
                let random = |heads, seq| {
                    Tensor::<4>::random([b, heads, seq, d], Distribution::Normal(0.0, 1.0), &device)
                        .cast(dtype)
                };
                let drawn = Instant::now();
                let cached = || {
                    let buffer = random(hkv, sk + args.cache_slack);
                    buffer.slice(s![.., .., 0..sk])
                };
                let inputs = [random(hq, args.sq), cached(), cached()];
                device.sync().expect("device sync");
                let drawn = drawn.elapsed();
                let [q, k, v] = &inputs;
                let plan = flash_attention_plan(q, k, v, FlashAttentionOptions::causal());
                eprintln!(
                    "{shape:?}: burn-flash runs {}; inputs drawn in {:.1} s",
                    plan.map_or_else(|e| e.to_string(), |p| p.to_string()),
                    drawn.as_secs_f64()
                );
                let lengths = || {
                    let lengths = TensorData::new(vec![sk as u32; b], [b]);
                    Tensor::<1, Int>::from_data(lengths, &device)
                };
                let cached = match args.page_size {
                    Some(page) => {
                        let per_sequence = sk.div_ceil(page);
                        let pages = b * per_sequence;
                        let pool = || {
                            Tensor::<4>::random(
                                [pages, page, hkv, d],
                                Distribution::Normal(0.0, 1.0),
                                &device,
                            )
                            .cast(dtype)
                        };
                        // Page `i` of the sequences' run at `(i · 7919) mod pages` (a prime:
                        // a shuffle wherever `pages` is not its multiple).
                        let table: Vec<u32> =
                            (0..pages).map(|i| ((i * 7919) % pages) as u32).collect();
                        let table = TensorData::new(table, [b, per_sequence]);
                        let table = Tensor::<2, Int>::from_data(table, &device);
                        Some(Cached {
                            lengths: lengths(),
                            pages: Some((pool(), pool(), table)),
                        })
                    }
                    None if args.key_lengths => Some(Cached {
                        lengths: lengths(),
                        pages: None,
                    }),
                    None => None,
                };
                device.sync().expect("device sync");
                for &imp in &args.impls {
                    let cached = cached.as_ref().filter(|_| imp == Impl::Flash);
                    let ms = time_row(&device, &args, imp, &inputs, cached, clear.as_mut());
                    let gbps = shape.bytes(elem) / (ms * 1e-3) / 1e9;
                    let suffix = match cached {
                        Some(Cached { pages: Some(_), .. }) => "-paged",
                        Some(_) => "-lengths",
                        None => "",
                    };
                    println!(
                        "{}{suffix},{dtype_name},{b},{hq},{hkv},{},{sk},{d},{ms:.4},{gbps:.1}",
                        name(imp),
                        args.sq
                    );
                }
                device.memory_cleanup();
            }
        }
    }
}
