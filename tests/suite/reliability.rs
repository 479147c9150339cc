//! Reliability: random shapes and options from a fixed seed list, logits up to ±1e4, non-finite
//! inputs, many threads calling at once, and (CUDA) sequences of 256k keys, tensors, masks and
//! biases of more than 2^31 elements, and the ragged shapes `compute-sanitizer` runs over
//! (`scripts/gpu-run.sh sanitize`). The checks take the device and dtype as arguments; `wgpu` runs
//! them on the portable tile (lavapipe in CI), `cuda` on the tensor-core tile.

use crate::common;

use burn::tensor::{DType, Device, Tensor};
use burn_flash::{FlashAttentionOptions, flash_attention};
use common::{
    Inputs, Problem, Spec, error, random_normal, reference_attention, reference_grads,
    tensor_from_host, to_host, unfused_attention, unfused_grads, widen,
};

/// Slack of the "twice the unfused error" rule on the global relative error, so that a
/// baseline error of exactly 0 does not demand an exact 0.
const RULE_FLOOR: f64 = 1e-6;

/// The FlashAttention rule of DESIGN.md section 5 on one result: finite, and at most twice as
/// far from the f64 reference as the unfused computation in the same dtype (max abs error with
/// the rounding slack of one value of the reference's size, global relative error), plus
/// `slack` relative to the reference for an error source the unfused computation does not have.
#[allow(clippy::too_many_arguments)]
pub(crate) fn twice_unfused(
    label: &str,
    name: &str,
    got: &[f64],
    unfused: &[f64],
    reference: &[f64],
    row: usize,
    dtype: DType,
    slack: f64,
) -> Option<String> {
    let (fused, base) = (error(got, reference, row), error(unfused, reference, row));
    let atol = (4.0 * common::unit_roundoff(dtype) + slack) * base.ref_max.max(1.0);
    eprintln!("{label}: {name}: fused {fused}; unfused {base}");
    let ok = fused.finite()
        && base.finite()
        && fused.max_abs <= 2.0 * base.max_abs + atol
        && fused.relative <= 2.0 * base.relative + RULE_FLOOR + slack;
    (!ok).then(|| format!("{label}: {name}: fused {fused}; unfused {base}"))
}

/// Inputs whose scaled scores span `[-max_logit, max_logit]` with exact ties: `q` and `k` hold
/// -1, 0 and 1 (exact in every dtype), so `q·k` are small integers computed exactly, and the
/// scale maps the largest `|q·k|` to `max_logit`. Every row's softmax is then uniform over its
/// tied best keys and 0 (below e^-100) elsewhere: an overflow, a missed rescale or a wrong
/// max shows as O(1) errors, while rounding does not blur the ties. `v` is standard normal.
fn extreme_inputs(problem: Problem, dtype: DType, seed: u64, max_logit: f64) -> (Inputs, f64) {
    let ternary = |len: usize, seed: u64| {
        random_normal(len, seed, DType::F32)
            .into_iter()
            .map(|x| {
                if x > 0.43 {
                    1.0
                } else if x < -0.43 {
                    -1.0
                } else {
                    0.0
                }
            })
            .collect::<Vec<f32>>()
    };
    let p = problem;
    let inputs = Inputs {
        problem,
        dtype,
        q: ternary(p.q_dims().iter().product(), seed ^ 0x11),
        k: ternary(p.k_dims().iter().product(), seed ^ 0x22),
        v: random_normal(p.v_dims().iter().product(), seed ^ 0x33, dtype),
    };
    let d = p.head_dim;
    let mut largest = 1f64;
    for bh in 0..p.batch * p.heads {
        let kv = p.kv_index(bh);
        for i in 0..p.seq_q {
            let q_row = &inputs.q[(bh * p.seq_q + i) * d..][..d];
            for j in 0..p.seq_k {
                let k_row = &inputs.k[(kv * p.seq_k + j) * d..][..d];
                let dot: f32 = q_row.iter().zip(k_row).map(|(a, b)| a * b).sum();
                largest = largest.max(dot.abs() as f64);
            }
        }
    }
    (inputs, max_logit / largest)
}

/// Output and gradients of `problem` with scores up to ±1e4 (see [`extreme_inputs`]) against
/// the f64 reference, by the rule of [`twice_unfused`]. Returns what failed.
///
/// The gradients get a slack the unfused path does not need: the backward recomputes
/// `P = exp(s − lse)` from the log-sum-exp stored in f32 (as FlashAttention-2 does), and at
/// `|lse| ≈ 1e4` its rounding alone, up to `|lse| · 2^-24`, is a relative error of P of about
/// 6e-4. Twice that is allowed; a wrong max, an overflow or a missed rescale costs O(1).
pub(crate) fn extreme_logits(
    device: &Device,
    dtype: DType,
    cases: &[(Problem, bool)],
) -> Vec<String> {
    burn_flash::testing::poison_outputs(true);
    let mut failures = Vec::new();
    let max_logit = 1e4;
    let lse_rounding = 2.0 * max_logit * common::unit_roundoff(DType::F32);
    for (index, &(problem, causal)) in cases.iter().enumerate() {
        let seed = 700 + index as u64;
        let (inputs, scale) = extreme_inputs(problem, dtype, seed, max_logit);
        let label = format!("{problem} causal {causal} logits ±1e4 {dtype:?}");
        let upstream = random_normal(problem.out_dims().iter().product(), seed ^ 0x44, dtype);
        let options = FlashAttentionOptions::new()
            .with_causal(causal)
            .with_scale(scale);

        let [q, k, v] = inputs.to_device(device).map(|t| t.require_grad());
        let out = flash_attention(q.clone(), k.clone(), v.clone(), options);
        let grad_out = tensor_from_host(&upstream, problem.out_dims(), dtype, device);
        let got = to_host(out.clone());
        let grads = (out * grad_out).sum().backward();
        let fused = [&q, &k, &v].map(|t| t.grad(&grads).map(to_host).unwrap_or_default());

        let (q64, k64, v64) = (widen(&inputs.q), widen(&inputs.k), widen(&inputs.v));
        let spec = Spec::from(causal);
        let (reference, _) = reference_attention(&problem, &q64, &k64, &v64, spec, Some(scale));
        let (rq, rk, rv) = reference_grads(
            &problem,
            &q64,
            &k64,
            &v64,
            &widen(&upstream),
            spec,
            Some(scale),
        );
        let unfused = unfused_attention(&inputs, spec, Some(scale));
        let (uq, uk, uv) = unfused_grads(&inputs, &upstream, spec, Some(scale));
        let (d, dv) = (problem.head_dim, problem.value_dim);
        for (name, got, base, reference, row, slack) in [
            ("output", &got, &unfused, &reference, dv, 0.0),
            ("dq", &fused[0], &uq, &rq, d, lse_rounding),
            ("dk", &fused[1], &uk, &rk, d, lse_rounding),
            ("dv", &fused[2], &uv, &rv, dv, lse_rounding),
        ] {
            if got.len() != reference.len() {
                failures.push(format!("{label}: {name} missing"));
                continue;
            }
            failures.extend(twice_unfused(
                &label, name, got, base, reference, row, dtype, slack,
            ));
        }
    }
    failures
}

/// Where [`non_finite_inputs`] puts its non-finite values, in a `[2, 2, 70, 70]` causal call:
/// (batch 0, head 0) a NaN in query row 5; (1, 0) a +inf in key row 20; (1, 1) a NaN in value
/// row 40; (0, 1) stays finite.
fn poison_non_finite(inputs: &mut Inputs) {
    let p = inputs.problem;
    let (d, seq) = (p.head_dim, p.seq_q);
    let at = |bh: usize, row: usize, col: usize| (bh * seq + row) * d + col;
    inputs.q[at(0, 5, 3)] = f32::NAN;
    inputs.k[at(2, 20, 7)] = f32::INFINITY;
    inputs.v[at(3, 40, 0)] = f32::NAN;
}

/// Whether output row `row` of the flattened (batch, head) `bh` sees a value
/// [`poison_non_finite`] made non-finite (causal: row `i` sees keys `0..=i`), and whether that
/// value is a NaN.
fn sees_non_finite(bh: usize, row: usize) -> Option<bool> {
    match bh {
        0 => (row == 5).then_some(true),
        2 => (row >= 20).then_some(false),
        3 => (row >= 40).then_some(true),
        _ => None,
    }
}

/// NaN and infinity in `q`, `k` or `v` (see [`poison_non_finite`]), forward and backward: the
/// call completes; the (batch, head) pair without a non-finite input gets exactly the bits of
/// the same call on finite inputs (output and gradients). In output rows that do not see the
/// non-finite value, every finite element stays within a few roundings of the finite call (tiles
/// share rescaling decisions across rows, so not bit for bit); an element may turn NaN, since a
/// masked probability 0 still multiplies a NaN value row in the block's `P·V`, as in any
/// matmul-based attention. With `propagates`, output rows that see a NaN (in their query or in a
/// visible value) must hold a non-finite value: the NaN is not hidden behind a plausible number.
/// Returns what failed.
pub(crate) fn non_finite_inputs(
    device: &Device,
    dtype: DType,
    head_dim: usize,
    propagates: bool,
) -> Vec<String> {
    burn_flash::testing::poison_outputs(true);
    // Bits compared between calls: no dK/dV launch of the process splits meanwhile.
    let _whole = burn_flash::testing::tail_slots(0);
    let problem = Problem::square(2, 2, 70, head_dim);
    let clean = Inputs::random(problem, dtype, 31);
    let mut bad = Inputs::random(problem, dtype, 31);
    poison_non_finite(&mut bad);
    let upstream = random_normal(problem.out_dims().iter().product(), 32, dtype);
    let options = FlashAttentionOptions::causal().with_deterministic(true);
    let run = |inputs: &Inputs| {
        let [q, k, v] = inputs.to_device(device).map(|t| t.require_grad());
        let out = flash_attention(q.clone(), k.clone(), v.clone(), options);
        let g = tensor_from_host(&upstream, problem.out_dims(), dtype, device);
        let got = to_host(out.clone());
        let grads = (out * g).sum().backward();
        let [dq, dk, dv] = [&q, &k, &v].map(|t| t.grad(&grads).map(to_host).unwrap_or_default());
        [got, dq, dk, dv]
    };
    let (expected, got) = (run(&clean), run(&bad));
    let label = format!("non-finite inputs {dtype:?} d {head_dim}");
    let (seq, d) = (problem.seq_q, head_dim);
    let bits = |x: &[f64]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let mut failures = Vec::new();
    for (name, (e, g)) in ["output", "dq", "dk", "dv"]
        .into_iter()
        .zip(expected.iter().zip(&got))
    {
        if e.len() != 4 * seq * d || g.len() != 4 * seq * d {
            failures.push(format!("{label}: {name} missing"));
        } else if bits(&e[seq * d..2 * seq * d]) != bits(&g[seq * d..2 * seq * d]) {
            failures.push(format!(
                "{label}: {name} of the finite (batch 0, head 1) changed"
            ));
        }
    }
    let tolerance = 8.0 * common::unit_roundoff(dtype);
    let (mut nan_rows, mut nan_rows_non_finite) = (0, 0);
    for bh in 0..4 {
        for row in 0..seq {
            let at = (bh * seq + row) * d;
            let (e, g) = (&expected[0][at..at + d], &got[0][at..at + d]);
            match sees_non_finite(bh, row) {
                None => {
                    let close = e.iter().zip(g).all(|(e, g)| {
                        !g.is_finite() || (g - e).abs() <= tolerance * e.abs().max(1.0)
                    });
                    if !close {
                        failures.push(format!(
                            "{label}: output row {row} of (batch, head) {bh} sees no non-finite \
                             input but a finite value moved: {g:?} against {e:?}"
                        ));
                    }
                }
                Some(nan) => {
                    let non_finite = g.iter().any(|x| !x.is_finite());
                    if nan {
                        nan_rows += 1;
                        nan_rows_non_finite += non_finite as usize;
                        if propagates && !non_finite {
                            failures.push(format!(
                                "{label}: output row {row} of (batch, head) {bh} sees a NaN \
                                 but is finite: {g:?}"
                            ));
                        }
                    }
                }
            }
        }
    }
    eprintln!(
        "{label}: {nan_rows_non_finite} of the {nan_rows} output rows that see a NaN are non-finite"
    );
    failures
}

/// The calls of [`concurrent_calls`]: shapes, masks and seeds that differ from thread to thread.
fn concurrent_cases(head_dim: usize, dtype: DType) -> Vec<(Inputs, Spec)> {
    let band = |left| Spec {
        causal: true,
        left: Some(left),
        ..Spec::default()
    };
    [
        (Problem::square(1, 2, 70, head_dim), Spec::from(true)),
        (Problem::cross(2, 1, 33, 90, head_dim), Spec::from(false)),
        (
            Problem::cross(1, 4, 65, 40, head_dim).grouped(2),
            Spec::from(true),
        ),
        (Problem::square(1, 1, 130, head_dim), band(17)),
        (Problem::cross(1, 2, 1, 77, head_dim), Spec::from(false)),
        (Problem::square(2, 2, 64, head_dim), Spec::from(true)),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (p, spec))| (Inputs::random(p, dtype, 900 + i as u64), spec))
    .collect()
}

/// Output and gradient bits of one call (deterministic backward, upstream gradient from the
/// inputs' seed).
fn call_bits(device: &Device, inputs: &Inputs, spec: Spec) -> [Vec<u64>; 4] {
    let p = inputs.problem;
    let upstream = random_normal(p.out_dims().iter().product(), 77, inputs.dtype);
    let [q, k, v] = inputs.to_device(device).map(|t| t.require_grad());
    let options = spec.options(None).with_deterministic(true);
    let out = flash_attention(q.clone(), k.clone(), v.clone(), options);
    let g = tensor_from_host(&upstream, p.out_dims(), inputs.dtype, device);
    let got = to_host(out.clone());
    let grads = (out * g).sum().backward();
    let bits = |x: Vec<f64>| x.into_iter().map(f64::to_bits).collect::<Vec<u64>>();
    let grad = |t: &Tensor<4>| bits(t.grad(&grads).map(to_host).unwrap_or_default());
    [bits(got), grad(&q), grad(&k), grad(&v)]
}

/// Many threads calling the fused forward and backward on one device at once, each call on its
/// own inputs, give the bits the same calls give one at a time. Returns what failed.
pub(crate) fn concurrent_calls(device: &Device, dtype: DType, head_dim: usize) -> Vec<String> {
    burn_flash::testing::poison_outputs(true);
    // Bits compared between calls: no dK/dV launch of the process splits meanwhile.
    let _whole = burn_flash::testing::tail_slots(0);
    let cases = concurrent_cases(head_dim, dtype);
    let alone: Vec<_> = cases
        .iter()
        .map(|(inputs, spec)| call_bits(device, inputs, *spec))
        .collect();
    let threads = 2 * cases.len();
    let failures: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (cases, alone) = (&cases, &alone);
                scope.spawn(move || {
                    let mut failures = Vec::new();
                    for round in 0..3 {
                        let i = (t + round) % cases.len();
                        let (inputs, spec) = &cases[i];
                        if call_bits(device, inputs, *spec) != alone[i] {
                            failures.push(format!(
                                "thread {t} round {round}: {} {spec} differs from the call alone",
                                inputs.problem
                            ));
                        }
                    }
                    failures
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| {
                h.join()
                    .unwrap_or_else(|_| vec!["a thread panicked".into()])
            })
            .collect()
    });
    eprintln!(
        "{threads} threads × 3 calls on one device, {dtype:?} d {head_dim}: {} failures",
        failures.len()
    );
    failures
}

mod wgpu {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The autodiff wgpu device the checks run on.
    fn device() -> Device {
        Device::wgpu(Default::default()).autodiff()
    }

    /// One random call: sizes (grouped heads, lengths 1 to 80 either side, head dims up to 64,
    /// sometimes a different value dim), mask (causal, one- or two-sided windows), softcap and
    /// scale, all drawn from `seed`.
    fn draw(seed: u64) -> (Problem, Spec, Option<f64>) {
        let mut rng = StdRng::seed_from_u64(seed);
        let kv_heads = rng.random_range(1..=2);
        let heads = kv_heads * rng.random_range(1..=3);
        let head_dim = [4, 8, 16, 24, 32, 40, 64][rng.random_range(0..7)];
        let mut problem = Problem::cross(
            rng.random_range(1..=2),
            heads,
            rng.random_range(1..=80),
            rng.random_range(1..=80),
            head_dim,
        )
        .grouped(kv_heads);
        if rng.random_bool(0.2) {
            problem.value_dim = [8, 16, 48][rng.random_range(0..3)];
        }
        let causal = rng.random_bool(0.5);
        let left = rng.random_bool(0.3).then(|| rng.random_range(0..=40));
        let right = (!causal && rng.random_bool(0.3)).then(|| rng.random_range(0..=40));
        let softcap = rng.random_bool(0.25).then(|| rng.random_range(1.0..20.0));
        let scale = rng.random_bool(0.3).then(|| rng.random_range(0.05..1.5));
        let spec = Spec {
            causal,
            left,
            right,
            softcap,
            top_left: false,
        };
        (problem, spec, scale)
    }

    /// Random shapes and options (see [`draw`]) forward and backward against the f64 reference,
    /// by `features_wgpu`'s check. The seeds are fixed so a failure reproduces:
    /// `BURN_FLASH_PROPERTY_SEEDS=17` reruns one, `=0..500` runs more.
    #[test]
    fn property_cases() {
        let seeds = match std::env::var("BURN_FLASH_PROPERTY_SEEDS") {
            Ok(value) => match value.split_once("..") {
                Some((a, b)) => a.parse().unwrap()..b.parse().unwrap(),
                None => value.parse().unwrap()..value.parse::<u64>().unwrap() + 1,
            },
            Err(_) => 0..16,
        };
        let mut failures = Vec::new();
        for seed in seeds {
            let (problem, spec, scale) = draw(seed);
            eprintln!("property seed {seed}: {problem} {spec} scale {scale:?}");
            failures.extend(crate::features_wgpu::check(
                problem,
                spec,
                scale,
                10_000 + seed,
                true,
            ));
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    fn extreme_logits_wgpu() {
        let cases = [
            (Problem::cross(1, 2, 40, 70, 32), false),
            (Problem::cross(2, 2, 70, 40, 64).grouped(1), true),
        ];
        let failures = extreme_logits(&device(), DType::F32, &cases);
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// WGSL lets implementations assume values are finite, so on wgpu the rows that see a NaN
    /// are not required to show it; everything else is.
    #[test]
    fn non_finite_inputs_wgpu() {
        let failures = non_finite_inputs(&device(), DType::F32, 32, false);
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    fn concurrent_calls_wgpu() {
        let failures = concurrent_calls(&device(), DType::F32, 32);
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}

/// The tensor-core tile on an autodiff CUDA device in bf16 (Burn 0.21: `Autodiff<Cuda<bf16>>`).
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use burn::tensor::Distribution;
    use burn_flash::{AttentionMask, flash_attention_masked};
    use common::{reference_row_keys, unfused_row_keys, unit_roundoff};

    /// The autodiff CUDA device, or `None` when the test skips (see `common::cuda`).
    fn cuda_device(test: &str) -> Option<Device> {
        crate::common::cuda::cuda_device(test).map(Device::autodiff)
    }

    fn assert_none(failures: Vec<String>) {
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    fn extreme_logits_cuda() {
        let Some(device) = cuda_device("extreme_logits_cuda") else {
            return;
        };
        let cases = [
            (Problem::square(1, 2, 150, 64), false),
            (Problem::cross(1, 2, 100, 180, 128), true),
            (Problem::cross(2, 4, 90, 130, 64).grouped(2), true),
        ];
        assert_none(extreme_logits(&device, DType::BF16, &cases));
    }

    #[test]
    fn non_finite_inputs_cuda() {
        let Some(device) = cuda_device("non_finite_inputs_cuda") else {
            return;
        };
        let mut failures = non_finite_inputs(&device, DType::BF16, 64, true);
        failures.extend(non_finite_inputs(&device, DType::BF16, 128, true));
        assert_none(failures);
    }

    #[test]
    fn concurrent_calls_cuda() {
        let Some(device) = cuda_device("concurrent_calls_cuda") else {
            return;
        };
        assert_none(concurrent_calls(&device, DType::BF16, 64));
    }

    /// The scores' gradient `dS_j = P_j (dP_j − D)` of one query row in f64 over the keys
    /// `seen`, with `P` the softmax of `scale · q·k_j + bias_j`, `dP_j = dO·v_j` and
    /// `D = Σ_j P_j dP_j`.
    fn reference_ds_row(
        q_row: &[f64],
        keys: &[f64],
        values: &[f64],
        g_row: &[f64],
        seen: &[usize],
        scale: f64,
        bias: Option<&[f64]>,
    ) -> Vec<f64> {
        let (d, dv) = (q_row.len(), g_row.len());
        let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
        let scores: Vec<f64> = seen
            .iter()
            .map(|&j| scale * dot(q_row, &keys[j * d..(j + 1) * d]) + bias.map_or(0.0, |b| b[j]))
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = weights.iter().sum();
        let dp: Vec<f64> = seen
            .iter()
            .map(|&j| dot(g_row, &values[j * dv..(j + 1) * dv]))
            .collect();
        let row_dot: f64 = weights.iter().zip(&dp).map(|(w, p)| w / sum * p).sum();
        weights
            .iter()
            .zip(&dp)
            .map(|(w, p)| w / sum * (p - row_dot))
            .collect()
    }

    /// dQ of one query row in f64: `scale · Σ_j dS_j k_j` over the keys `seen`
    /// ([`reference_ds_row`]).
    fn reference_dq_row(
        q_row: &[f64],
        keys: &[f64],
        values: &[f64],
        g_row: &[f64],
        seen: &[usize],
        scale: f64,
    ) -> Vec<f64> {
        let d = q_row.len();
        let ds = reference_ds_row(q_row, keys, values, g_row, seen, scale, None);
        let mut dq = vec![0.0; d];
        for (&j, ds) in seen.iter().zip(&ds) {
            for (o, k) in dq.iter_mut().zip(&keys[j * d..(j + 1) * d]) {
                *o += ds * scale * k;
            }
        }
        dq
    }

    /// Sampled rows of one (batch, head) of a long call: the output by the rule of
    /// [`twice_unfused`] (the unfused row emulated on the CPU in bf16), dQ within 16 units of
    /// bf16 roundoff of the f64 reference (the backward tests' sanity bound: an index error
    /// costs O(1)), every gradient value finite.
    #[allow(clippy::too_many_arguments)]
    fn check_rows(
        label: &str,
        [q, k, v, g]: [&[f32]; 4],
        [out, dq]: [&[f64]; 2],
        [dk, dv]: [&[f64]; 2],
        rows: &[usize],
        head_dim: usize,
        causal: bool,
        failures: &mut Vec<String>,
    ) {
        let d = head_dim;
        let seq = k.len() / d;
        let scale = 1.0 / (d as f64).sqrt();
        let (k64, v64) = (widen(k), widen(v));
        let spec = Spec::from(causal);
        for &i in rows {
            let seen = spec.visible(i, seq, seq);
            let q_row = &q[i * d..(i + 1) * d];
            let (reference, _) = reference_row_keys(
                &widen(q_row),
                &k64,
                &v64,
                d,
                &seen,
                scale,
                &spec,
                None,
                None,
            );
            let unfused =
                unfused_row_keys(q_row, k, v, d, &seen, scale, &spec, None, None, DType::BF16);
            let at = i * d..(i + 1) * d;
            failures.extend(twice_unfused(
                &format!("{label} row {i}"),
                "output",
                &out[at.clone()],
                &unfused,
                &reference,
                d,
                DType::BF16,
                0.0,
            ));
            let rq = reference_dq_row(
                &widen(q_row),
                &k64,
                &v64,
                &widen(&g[at.clone()]),
                &seen,
                scale,
            );
            let err = error(&dq[at], &rq, d);
            eprintln!("{label} row {i}: dq {err}");
            if !(err.finite() && err.relative <= 16.0 * unit_roundoff(DType::BF16)) {
                failures.push(format!("{label} row {i}: dq {err}"));
            }
        }
        for (name, grad) in [("dq", dq), ("dk", dk), ("dv", dv)] {
            let bad = grad.iter().filter(|x| !x.is_finite()).count();
            if bad > 0 {
                failures.push(format!("{label}: {name} has {bad} non-finite values"));
            }
        }
    }

    /// b = 1, h = 1, n = 256k, d = 128, bf16, forward and backward, causal and not: sampled rows
    /// against the f64 reference, all gradients finite.
    #[test]
    fn long_sequence_256k_cuda() {
        let Some(device) = cuda_device("long_sequence_256k_cuda") else {
            return;
        };
        burn_flash::testing::poison_outputs(true);
        let n = 1 << 18;
        let problem = Problem::square(1, 1, n, 128);
        let inputs = Inputs::random(problem, DType::BF16, 256);
        let upstream = random_normal(n * 128, 257, DType::BF16);
        let mut failures = Vec::new();
        for causal in [false, true] {
            let started = std::time::Instant::now();
            let [q, k, v] = inputs.to_device(&device).map(|t| t.require_grad());
            let options = FlashAttentionOptions::new().with_causal(causal);
            let out = flash_attention(q.clone(), k.clone(), v.clone(), options);
            let g = tensor_from_host(&upstream, problem.out_dims(), DType::BF16, &device);
            let got = to_host(out.clone());
            let grads = (out * g).sum().backward();
            let [dq, dk, dv] =
                [&q, &k, &v].map(|t| t.grad(&grads).map(to_host).unwrap_or_default());
            let label = format!("n {n} d 128 causal {causal}");
            eprintln!("{label}: forward and backward in {:.2?}", started.elapsed());
            check_rows(
                &label,
                [&inputs.q, &inputs.k, &inputs.v, &upstream],
                [&got, &dq],
                [&dk, &dv],
                &[0, 1, n / 2 + 17, n - 2, n - 1],
                128,
                causal,
                &mut failures,
            );
        }
        assert_none(failures);
    }

    /// A call whose tensors hold more than 2^31 elements (b 4, h 130, n 32768, d 128: 2.18e9
    /// each, 4.4 GB in bf16), causal, forward and backward: indices past `i32::MAX`, still
    /// within the 32-bit unsigned indices CubeCL 0.12 keeps up to `u32::MAX` elements (the
    /// 64-bit build is `backward_cuda::wide_indices_bf16`'s). Sampled rows of the first and the last (batch, head) against the f64 reference,
    /// the gradients of both finite.
    #[test]
    fn beyond_2_pow_31_elements_cuda() {
        let Some(device) = cuda_device("beyond_2_pow_31_elements_cuda") else {
            return;
        };
        burn_flash::testing::poison_outputs(true);
        let (b, h, n, d) = (4, 130, 1 << 15, 128);
        assert!(b * h * n * d > 1 << 31);
        let started = std::time::Instant::now();
        device.seed(2031);
        let random = || {
            Tensor::<4>::random(
                [b, h, n, d],
                Distribution::Normal(0.0, 1.0),
                (&device, DType::BF16),
            )
        };
        let (q, k, v, g) = (random(), random(), random(), random());
        let [q, k, v] = [q, k, v].map(|t| t.require_grad());
        let out = flash_attention(
            q.clone(),
            k.clone(),
            v.clone(),
            FlashAttentionOptions::causal(),
        );
        let out_detached = out.clone().detach();
        let grads = (out * g.clone()).sum().backward();
        let [dq, dk, dv] = [&q, &k, &v].map(|t| t.grad(&grads).unwrap());
        let mut failures = Vec::new();
        for (bi, hi) in [(0, 0), (b - 1, h - 1)] {
            let slab = |t: &Tensor<4>| t.clone().slice([bi..bi + 1, hi..hi + 1]);
            let host32 = |t: &Tensor<4>| {
                to_host(slab(t))
                    .into_iter()
                    .map(|x| x as f32)
                    .collect::<Vec<f32>>()
            };
            let (hq, hk, hv, hg) = (host32(&q), host32(&k), host32(&v), host32(&g));
            check_rows(
                &format!("b {b} h {h} n {n}: (batch, head) ({bi}, {hi})"),
                [&hq, &hk, &hv, &hg],
                [&to_host(slab(&out_detached)), &to_host(slab(&dq))],
                [&to_host(slab(&dk)), &to_host(slab(&dv))],
                &[0, 4097, n - 1],
                d,
                true,
                &mut failures,
            );
        }
        eprintln!(
            "b {b} h {h} n {n} d {d}: forward, backward and checks in {:.2?}",
            started.elapsed()
        );
        assert_none(failures);
    }

    /// A mask and a bias of more than 2^31 elements each (`[1, 3, 32768, 32768]`: 3.2e9, the
    /// bias 6.4 GB in bf16) beside small `q`, `k`, `v` (`[1, 3, 32768, 64]`): the launches must
    /// take 64-bit indexing from the mask, the bias and the bias gradient alone. Sampled rows of
    /// the last head (wholly past 2^31) and the first: the output by the unfused rule, the bias
    /// gradient within 16 units of bf16 roundoff of the f64 reference.
    #[test]
    fn mask_and_bias_beyond_2_pow_31_elements_cuda() {
        let Some(device) = cuda_device("mask_and_bias_beyond_2_pow_31_elements_cuda") else {
            return;
        };
        burn_flash::testing::poison_outputs(true);
        let (h, n, d) = (3, 1 << 15, 64);
        assert!(h * n * n > 1 << 31 && h * n * d < 1 << 31);
        let started = std::time::Instant::now();
        device.seed(2032);
        let random = |dims: [usize; 4]| {
            Tensor::<4>::random(dims, Distribution::Normal(0.0, 1.0), (&device, DType::BF16))
        };
        let (q, k, v, g) = (
            random([1, h, n, d]),
            random([1, h, n, d]),
            random([1, h, n, d]),
            random([1, h, n, d]),
        );
        let bias = random([1, h, n, n]).require_grad();
        // About 10 % of the pairs hidden.
        let mask = Tensor::<4>::random(
            [1, h, n, n],
            Distribution::Uniform(0.0, 1.0),
            (&device, DType::BF16),
        )
        .lower_elem(0.1);
        let out = flash_attention_masked(
            q.clone(),
            k.clone(),
            v.clone(),
            Some(AttentionMask::Full(mask.clone())),
            Some(bias.clone()),
            FlashAttentionOptions::default(),
        );
        let grads = (out.clone() * g.clone()).sum().backward();
        let dbias = bias.grad(&grads).unwrap();
        let scale = 1.0 / (d as f64).sqrt();
        let mut failures = Vec::new();
        for hi in [h - 1, 0] {
            let head = |t: &Tensor<4>| {
                let values = to_host(t.clone().slice([0..1, hi..hi + 1]));
                values.into_iter().map(|x| x as f32).collect::<Vec<f32>>()
            };
            let (hq, hk, hv, hg) = (head(&q), head(&k), head(&v), head(&g));
            let (k64, v64) = (widen(&hk), widen(&hv));
            for i in [n - 1, n / 2 + 17, 0] {
                let row = |t: Tensor<4>| t.slice([0..1, hi..hi + 1, i..i + 1]);
                let hidden: Vec<bool> = (mask.clone().slice([0..1, hi..hi + 1, i..i + 1]))
                    .into_data()
                    .iter::<bool>()
                    .collect();
                let bias_row = to_host(row(bias.clone().detach()));
                let seen: Vec<usize> = (0..n).filter(|&j| !hidden[j]).collect();
                let (q_row, g_row) = (&hq[i * d..(i + 1) * d], widen(&hg[i * d..(i + 1) * d]));
                let spec = Spec::default();
                let (reference, _) = reference_row_keys(
                    &widen(q_row),
                    &k64,
                    &v64,
                    d,
                    &seen,
                    scale,
                    &spec,
                    Some(&bias_row),
                    None,
                );
                let unfused = unfused_row_keys(
                    q_row,
                    &hk,
                    &hv,
                    d,
                    &seen,
                    scale,
                    &spec,
                    Some(&bias_row),
                    None,
                    DType::BF16,
                );
                let label = format!("h {h} n {n}: head {hi} row {i}");
                failures.extend(twice_unfused(
                    &label,
                    "output",
                    &to_host(row(out.clone().detach())),
                    &unfused,
                    &reference,
                    d,
                    DType::BF16,
                    0.0,
                ));
                // dBias = dS on the seen keys, 0 on the hidden ones.
                let ds = reference_ds_row(
                    &widen(q_row),
                    &k64,
                    &v64,
                    &g_row,
                    &seen,
                    scale,
                    Some(&bias_row),
                );
                let mut expected = vec![0.0; n];
                for (&j, ds) in seen.iter().zip(ds) {
                    expected[j] = ds;
                }
                let err = error(&to_host(row(dbias.clone())), &expected, n);
                eprintln!("{label}: dbias {err}");
                if !(err.finite() && err.relative <= 16.0 * unit_roundoff(DType::BF16)) {
                    failures.push(format!("{label}: dbias {err}"));
                }
            }
        }
        eprintln!(
            "h {h} n {n} d {d}: mask and bias of {} elements, forward, backward and checks in {:.2?}",
            h * n * n,
            started.elapsed()
        );
        assert_none(failures);
    }

    /// Decoding against caches of more than `u32::MAX` elements (`[1, 32, 2^20 + 256, 128]`,
    /// and grouped: 32 query heads over `[1, 8, 2^22 + 64, 128]`; 8.6 GB each in bf16): keys
    /// and values staged by tensor maps are not indexed by the kernel, so the launch keeps
    /// 32-bit arithmetic where the copies would need 64 (on devices with tensor maps). The
    /// last head's rows lie past element 2^32: its output (and the first head's) by the
    /// unfused rule against the f64 reference.
    #[test]
    fn decoding_past_u32_max_cache_elements_cuda() {
        let Some(device) = cuda_device("decoding_past_u32_max_cache_elements_cuda") else {
            return;
        };
        burn_flash::testing::poison_outputs(true);
        let d = 128;
        let mut failures = Vec::new();
        for (heads, kv_heads, keys) in [(32, 32, (1 << 20) + 256), (32, 8, (1 << 22) + 64)] {
            assert!(kv_heads * keys * d > u32::MAX as usize);
            let started = std::time::Instant::now();
            device.seed(2033 + kv_heads as u64);
            let random = |dims: [usize; 4]| {
                Tensor::<4>::random(dims, Distribution::Normal(0.0, 1.0), (&device, DType::BF16))
            };
            let (q, k, v) = (
                random([1, heads, 1, d]),
                random([1, kv_heads, keys, d]),
                random([1, kv_heads, keys, d]),
            );
            let (tma, wide) = (
                burn_flash::testing::tma_launches(),
                burn_flash::testing::wide_forward_launches(),
            );
            let out = flash_attention(
                q.clone(),
                k.clone(),
                v.clone(),
                FlashAttentionOptions::default(),
            );
            let out = to_host(out);
            let staged_by_maps = burn_flash::testing::tma_launches() > tma;
            let label = format!("{heads}/{kv_heads} heads, {keys} keys");
            eprintln!(
                "{label}: forward in {:.2?}, tensor maps {staged_by_maps}",
                started.elapsed()
            );
            if staged_by_maps && burn_flash::testing::wide_forward_launches() > wide {
                failures.push(format!(
                    "{label}: staged by tensor maps, yet a 64-bit launch"
                ));
            }
            let scale = 1.0 / (d as f64).sqrt();
            let seen: Vec<usize> = (0..keys).collect();
            let spec = Spec::from(false);
            for head in [0, heads - 1] {
                let kv_head = head / (heads / kv_heads);
                let host32 = |t: &Tensor<4>, h: usize| {
                    to_host(t.clone().slice([0..1, h..h + 1]))
                        .into_iter()
                        .map(|x| x as f32)
                        .collect::<Vec<f32>>()
                };
                let (hq, hk, hv) = (host32(&q, head), host32(&k, kv_head), host32(&v, kv_head));
                let (reference, _) = reference_row_keys(
                    &widen(&hq),
                    &widen(&hk),
                    &widen(&hv),
                    d,
                    &seen,
                    scale,
                    &spec,
                    None,
                    None,
                );
                let unfused = unfused_row_keys(
                    &hq,
                    &hk,
                    &hv,
                    d,
                    &seen,
                    scale,
                    &spec,
                    None,
                    None,
                    DType::BF16,
                );
                failures.extend(twice_unfused(
                    &format!("{label} head {head}"),
                    "output",
                    &out[head * d..(head + 1) * d],
                    &unfused,
                    &reference,
                    d,
                    DType::BF16,
                    0.0,
                ));
            }
        }
        assert_none(failures);
    }

    /// Ragged shapes through every kernel (forward, both backward dQ modes; grouped heads, a
    /// two-sided window, the softcap), checked against the f64 reference within the backward
    /// tests' sanity bound: the shapes `compute-sanitizer` runs over (`scripts/gpu-run.sh
    /// sanitize`), so a clean report covers every launch.
    #[test]
    fn sanitizer_shapes_cuda() {
        let Some(device) = cuda_device("sanitizer_shapes_cuda") else {
            return;
        };
        burn_flash::testing::poison_outputs(true);
        // `deterministic: false` below must run the atomic dQ, not the faster launch for these
        // short sequences.
        let _atomic = burn_flash::testing::force_atomic_dq();
        let cases = [
            (Problem::cross(1, 2, 77, 131, 64), Spec::from(true)),
            (
                Problem::square(1, 1, 93, 128),
                Spec {
                    left: Some(40),
                    right: Some(7),
                    ..Spec::default()
                },
            ),
            (
                Problem::cross(2, 4, 45, 70, 64).grouped(2),
                Spec {
                    causal: true,
                    softcap: Some(5.0),
                    ..Spec::default()
                },
            ),
        ];
        let bound = 16.0 * unit_roundoff(DType::BF16);
        let mut failures = Vec::new();
        for (index, (problem, spec)) in cases.into_iter().enumerate() {
            let inputs = Inputs::random(problem, DType::BF16, 300 + index as u64);
            let upstream = random_normal(problem.out_dims().iter().product(), 400, DType::BF16);
            let (q64, k64, v64) = (widen(&inputs.q), widen(&inputs.k), widen(&inputs.v));
            let (reference, _) = reference_attention(&problem, &q64, &k64, &v64, spec, None);
            let (rq, rk, rv) =
                reference_grads(&problem, &q64, &k64, &v64, &widen(&upstream), spec, None);
            for deterministic in [true, false] {
                let [q, k, v] = inputs.to_device(&device).map(|t| t.require_grad());
                let options = spec.options(None).with_deterministic(deterministic);
                let out = flash_attention(q.clone(), k.clone(), v.clone(), options);
                let g = tensor_from_host(&upstream, problem.out_dims(), DType::BF16, &device);
                let got = to_host(out.clone());
                let grads = (out * g).sum().backward();
                let grad = |t: &Tensor<4>| t.grad(&grads).map(to_host).unwrap_or_default();
                let label = format!("{problem} {spec} deterministic {deterministic}");
                for (name, got, reference, row) in [
                    ("output", got, &reference, problem.value_dim),
                    ("dq", grad(&q), &rq, problem.head_dim),
                    ("dk", grad(&k), &rk, problem.head_dim),
                    ("dv", grad(&v), &rv, problem.value_dim),
                ] {
                    if got.len() != reference.len() {
                        failures.push(format!("{label}: {name} missing"));
                        continue;
                    }
                    let err = error(&got, reference, row);
                    eprintln!("{label}: {name} {err}");
                    if !(err.finite() && err.relative <= bound) {
                        failures.push(format!("{label}: {name} {err}"));
                    }
                }
            }
        }
        assert_none(failures);
    }
}
