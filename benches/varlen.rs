//! Variable-length batches: sequences of mixed lengths packed along the rows
//! (`try_flash_attention_varlen`, rows named `burn-flash-varlen`) against this crate's dense
//! kernel on the same sequences padded to the longest (`flash_attention` on `[b, h, longest,
//! d]`, rows named `burn-flash-padded`), self-attention, forward (`fwd`) and forward + backward
//! on the autodiff device (`fwdbwd`). CSV on stdout, with the columns of
//! `scripts/torch_varlen_bench.py` so both tables can be joined:
//!
//! ```text
//! impl,dtype,seqs,tokens,longest,h,hkv,d,causal,mode,ms,tflops
//! ```
//!
//! ```text
//! cargo bench --features cuda --bench varlen -- --mean 512,2048 --d 64,128
//! cargo bench --bench varlen -- --help
//! ```
//!
//! The lengths: `--tokens` rows per batch in sequences drawn uniformly from `1..2·mean` by
//! splitmix64 from `--seed` (the last one cut to fill the batch), as the torch script draws
//! them. TFLOPS counts the work of the real tokens only, `4·h·d·Σ l²` (halved when causal),
//! times 3.5 for `fwdbwd`, for both rows: at equal TFLOPS the two take the same time per real
//! token. Method as `benches/attention.rs`'s default (`b2b`): a first call and `--warmup` more
//! untimed, then `--iters` samples of calls issued back to back (about 20 ms of them, at most
//! 50), the median per call.

// The timing helpers; the implementations' names and the L2 clear are the other benches'.
#[allow(dead_code)]
mod common;

use burn::tensor::{DType, Distribution, Tensor};
use burn_flash::{
    FlashAttentionOptions, PackedSequences, flash_attention, try_flash_attention_varlen,
};
use clap::Parser;
use clap::builder::RangedU64ValueParser;

use common::{Backend, median_ms, select_device, timed};

/// Varlen timings of burn-flash, packed against padded, as CSV (see the header of
/// `benches/varlen.rs`).
#[derive(Parser, Debug)]
#[command(name = "varlen", bin_name = "varlen")]
struct Args {
    /// Mean sequence lengths, one batch each [default: 512,2048 on CUDA, 64 on wgpu].
    #[arg(long, value_delimiter = ',')]
    mean: Vec<usize>,
    /// Rows (tokens) per batch [default: 16384 on CUDA, 512 on wgpu].
    #[arg(long)]
    tokens: Option<usize>,
    /// Head dims [default: 64,128 on CUDA, 32 on wgpu].
    #[arg(long, value_delimiter = ',')]
    d: Vec<usize>,
    /// Query heads; 0 means 2048 / d on CUDA, 128 / d on wgpu.
    #[arg(long, default_value_t = 0)]
    h: usize,
    /// Key/value heads; 0 means h.
    #[arg(long, default_value_t = 0)]
    hkv: usize,
    /// Causal mask: `true`, `false` or `both`.
    #[arg(long, default_value = "both")]
    causal: String,
    /// `fwd`, `fwdbwd` or both, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "fwd,fwdbwd")]
    modes: Vec<String>,
    /// The lengths' seed (the torch script draws the same lengths from it).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    backend: Backend,
    /// Timed samples per row.
    #[arg(long, default_value_t = 10, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    iters: usize,
    /// Untimed calls after the first.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
}

/// splitmix64: the `n`-th value of the stream of `seed`.
fn splitmix64(seed: u64, n: u64) -> u64 {
    let mut z = seed.wrapping_add((n + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Lengths uniform in `1..2·mean` adding up to `tokens`, the last one cut.
fn lengths(tokens: usize, mean: usize, seed: u64) -> Vec<usize> {
    let mut lengths = Vec::new();
    let mut total = 0;
    while total < tokens {
        let n = 1 + (splitmix64(seed, lengths.len() as u64) % (2 * mean as u64 - 1)) as usize;
        let n = n.min(tokens - total);
        lengths.push(n);
        total += n;
    }
    lengths
}

/// One call of `imp` (`varlen` or padded) on its inputs; under `backward`, its gradients too.
fn call(
    varlen: bool,
    packed: &PackedSequences,
    inputs: &[Tensor<4>; 3],
    options: FlashAttentionOptions,
    backward: bool,
) {
    let [q, k, v] = inputs
        .clone()
        .map(|t| if backward { t.require_grad() } else { t });
    let out = if varlen {
        let rows = |t: Tensor<4>| t.squeeze_dim::<3>(0);
        try_flash_attention_varlen(rows(q), rows(k), rows(v), packed, options)
            .expect("valid packing")
            .sum()
    } else {
        flash_attention(q, k, v, options).sum()
    };
    if backward {
        let _grads = out.backward();
    }
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
    let means = or(&args.mean, &[512, 2048], &[64]);
    let dims = or(&args.d, &[64, 128], &[32]);
    let tokens = args.tokens.unwrap_or(if cuda { 16384 } else { 512 });
    let (dtype, dtype_name) = if cuda {
        (DType::BF16, "bf16")
    } else {
        (DType::F32, "f32")
    };
    let causals: Vec<bool> = match args.causal.as_str() {
        "both" => vec![false, true],
        other => vec![other.parse().expect("--causal true, false or both")],
    };
    println!("impl,dtype,seqs,tokens,longest,h,hkv,d,causal,mode,ms,tflops");
    for &mean in &means {
        let lengths = lengths(tokens, mean, args.seed);
        let longest = lengths.iter().copied().max().unwrap_or(0);
        eprintln!(
            "mean {mean}: {} sequences, longest {longest}, padded to {} rows",
            lengths.len(),
            lengths.len() * longest
        );
        for &d in &dims {
            let h = if args.h > 0 {
                args.h
            } else {
                (if cuda { 2048 } else { 128 }) / d
            };
            let hkv = if args.hkv > 0 { args.hkv } else { h };
            for mode in &args.modes {
                let backward = match mode.as_str() {
                    "fwd" => false,
                    "fwdbwd" => true,
                    other => panic!("unknown mode {other}: fwd or fwdbwd"),
                };
                let device = if backward {
                    device.clone().autodiff()
                } else {
                    device.clone()
                };
                let packed = PackedSequences::new(&lengths, &device);
                for &causal in &causals {
                    let options = FlashAttentionOptions::new().with_causal(causal);
                    let pairs: f64 = lengths
                        .iter()
                        .map(|&l| {
                            if causal {
                                (l * (l + 1) / 2) as f64
                            } else {
                                (l * l) as f64
                            }
                        })
                        .sum();
                    let flops = 4.0 * (h * d) as f64 * pairs * if backward { 3.5 } else { 1.0 };
                    let random = |dims: [usize; 4]| {
                        Tensor::<4>::random(dims, Distribution::Normal(0.0, 1.0), &device)
                            .cast(dtype)
                    };
                    let b = lengths.len();
                    for varlen in [true, false] {
                        let inputs = if varlen {
                            [[1, tokens, h, d], [1, tokens, hkv, d], [1, tokens, hkv, d]]
                        } else {
                            [
                                [b, h, longest, d],
                                [b, hkv, longest, d],
                                [b, hkv, longest, d],
                            ]
                        }
                        .map(random);
                        let step = |_| call(varlen, &packed, &inputs, options, backward);
                        step(0);
                        for _ in 0..args.warmup {
                            step(0);
                        }
                        let once = timed(&device, 1, step).0;
                        let batch = ((0.02 / once.as_secs_f64().max(1e-6)) as usize).clamp(1, 50);
                        let mut samples: Vec<_> = (0..args.iters)
                            .map(|_| timed(&device, batch, step).0)
                            .collect();
                        let ms = median_ms(&mut samples);
                        let name = if varlen { "varlen" } else { "padded" };
                        println!(
                            "burn-flash-{name},{dtype_name},{b},{tokens},{longest},{h},{hkv},{d},\
                             {causal},{mode},{ms:.4},{:.1}",
                            flops / (ms * 1e-3) / 1e12
                        );
                        device.memory_cleanup();
                    }
                }
            }
        }
    }
}
