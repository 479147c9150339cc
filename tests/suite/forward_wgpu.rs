//! The fused forward on a wgpu device (f32, the portable tile) against the f64 CPU
//! reference of `common`. In CI this runs on lavapipe, Mesa's Vulkan driver on the CPU: small
//! shapes only, and few distinct kernels (each (head dim, causal) pair is one shader to compile).
//!
//! Every output is poisoned with NaN before the kernel runs, so an element the kernel forgets to
//! write fails the test instead of passing on stale memory.

use crate::common;

use std::time::Instant;

use burn::tensor::{DType, Device};
use burn_flash::{
    FlashAttentionOptions, FlashAttentionPlan, TilePath, flash_attention, flash_attention_plan,
    flash_attention_with_lse,
};
use common::{Inputs, Problem, error, lse_error, masked_rows, to_host, visible_keys};

/// Tolerance of the f32 results, relative to the reference's norm (and, per element, to
/// `max(1, max |ref|)`).
///
/// Why 1e-4: the kernel computes in f32 (unit roundoff u = 6e-8). A score is a dot product of
/// `head_dim <= 128` terms and an output a weighted sum over `seq_k <= 200` keys with a few
/// online-softmax rescalings; the classical bounds are ~(head_dim + seq_k)·u ≈ 2e-5 in the worst
/// case and ~1e-6 in practice (the kernel is built with fast-math, which may use an approximate
/// `exp`; measured on lavapipe: ~1e-6). Any real bug is orders of magnitude larger: wrongly
/// masking or admitting one key out of 200 moves that row by ~1/200 = 5e-3, a wrong scale or a
/// missed rescale by O(1). The per-element bound catches a bug confined to one row, which the
/// norm over the whole tensor would dilute.
const TOLERANCE: f64 = 1e-4;

/// Which path a case must take.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Expect {
    /// The fused kernel with the portable tile.
    Portable,
    /// Burn's unfused fallback (a head dim the fused kernel does not support).
    Fallback,
    /// The fused kernel with the portable tile on head dims zero-padded to the tensor-core
    /// tile's sizes (under [`burn_flash::testing::pad_head_dims`]).
    Padded,
    /// Either; only the result is checked.
    Any,
}

/// One call: sizes, mask, scale, input seed.
#[derive(Clone, Copy, Debug)]
struct Case {
    problem: Problem,
    causal: bool,
    scale: Option<f64>,
    seed: u64,
}

impl core::fmt::Display for Case {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{} causal {}", self.problem, self.causal)?;
        if let Some(scale) = self.scale {
            write!(f, " scale {scale}")?;
        }
        write!(f, " seed {}", self.seed)
    }
}

/// Both mask settings for each problem, with distinct seeds.
fn cases(problems: &[Problem], first_seed: u64) -> Vec<Case> {
    problems
        .iter()
        .flat_map(|&problem| [false, true].map(|causal| (problem, causal)))
        .enumerate()
        .map(|(index, (problem, causal))| Case {
            problem,
            causal,
            scale: None,
            seed: first_seed + index as u64,
        })
        .collect()
}

/// Run one case through `flash_attention` and compare with the reference. Returns a description
/// of what is wrong, if anything.
fn check(case: Case, expect: Expect) -> Result<(), String> {
    let device = Device::wgpu(Default::default());
    burn_flash::testing::poison_outputs(true);
    let started = Instant::now();
    let Case {
        problem,
        causal,
        scale,
        seed,
    } = case;
    let inputs = Inputs::random(problem, DType::F32, seed);
    let [q, k, v] = inputs.to_device(&device);
    let mut options = FlashAttentionOptions::new().with_causal(causal);
    if let Some(scale) = scale {
        options = options.with_scale(scale);
    }

    let plan =
        flash_attention_plan(&q, &k, &v, options).map_err(|e| format!("{case}: refused: {e}"))?;
    let plan_ok = match expect {
        Expect::Portable => plan == FlashAttentionPlan::Fused(TilePath::Portable),
        Expect::Fallback => matches!(plan, FlashAttentionPlan::Fallback(_)),
        Expect::Padded => {
            plan == common::padded_plan(TilePath::Portable, &problem)
                && plan != FlashAttentionPlan::Fused(TilePath::Portable)
        }
        Expect::Any => true,
    };
    if !plan_ok {
        return Err(format!("{case}: plan is {plan}, expected {expect:?}"));
    }

    let out = flash_attention(q, k, v, options);
    if out.dims() != problem.out_dims() {
        return Err(format!("{case}: output dims {:?}", out.dims()));
    }
    let got = to_host(out);
    let (reference, _) = inputs.reference(causal, scale);
    let err = error(&got, &reference, problem.value_dim);
    eprintln!("{case}: {plan}: {err} in {:.2?}", started.elapsed());
    if !(err.finite()
        && err.relative <= TOLERANCE
        && err.max_abs <= TOLERANCE * err.ref_max.max(1.0))
    {
        return Err(format!("{case}: {plan}: {err}, tolerance {TOLERANCE:e}"));
    }
    // Rows that see no key must be exactly 0 (not NaN, not a stale value).
    let dv = problem.value_dim;
    for row in masked_rows(&problem, causal) {
        if got[row * dv..(row + 1) * dv].iter().any(|&x| x != 0.0) {
            return Err(format!("{case}: row {row} sees no key but is not 0"));
        }
    }
    Ok(())
}

/// Run all cases, then fail with every failure listed.
fn check_all(cases: &[Case], expect: Expect) {
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|&case| check(case, expect).err())
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// The reference itself, on cases whose answer is known without it.
#[test]
fn reference_self_check() {
    use common::reference_row;
    let (d, dv) = (4, 3);
    let keys: Vec<f64> = (0..5 * d).map(|x| (x as f64 * 0.37).sin()).collect();
    let values: Vec<f64> = (0..5 * dv).map(|x| (x as f64 * 0.71).cos()).collect();
    let q = [0.3, -1.2, 0.5, 2.0];

    // One visible key: the output is its value row, the lse its scaled score.
    let (out, lse) = reference_row(&q, &keys, &values, dv, 1, 0.5);
    assert_eq!(out, values[..dv]);
    let score: f64 = 0.5 * q.iter().zip(&keys[..d]).map(|(a, b)| a * b).sum::<f64>();
    assert!((lse - score).abs() < 1e-12);

    // A zero query: uniform weights, the mean of the visible values, lse = ln(visible).
    let (out, lse) = reference_row(&[0.0; 4], &keys, &values, dv, 5, 1.0);
    for (c, o) in out.iter().enumerate() {
        let mean = (0..5).map(|j| values[j * dv + c]).sum::<f64>() / 5.0;
        assert!((o - mean).abs() < 1e-12);
    }
    assert!((lse - 5f64.ln()).abs() < 1e-12);

    // A huge scale: the softmax picks the key with the largest score.
    let scores: Vec<f64> = (0..5)
        .map(|j| q.iter().zip(&keys[j * d..]).map(|(a, b)| a * b).sum())
        .collect();
    let best = (0..5)
        .max_by(|&a, &b| scores[a].total_cmp(&scores[b]))
        .unwrap();
    let (out, _) = reference_row(&q, &keys, &values, dv, 5, 1e4);
    for (c, o) in out.iter().enumerate() {
        assert!((o - values[best * dv + c]).abs() < 1e-9);
    }

    // No visible key: zeros and -inf.
    let (out, lse) = reference_row(&q, &keys, &values, dv, 0, 1.0);
    assert_eq!((out, lse), (vec![0.0; dv], f64::NEG_INFINITY));

    // The causal mask is aligned bottom-right.
    assert_eq!(visible_keys(0, 3, 3, true), 1);
    assert_eq!(visible_keys(2, 3, 3, true), 3);
    assert_eq!(visible_keys(0, 2, 5, true), 4); // a query block after a 3-key prefix
    assert_eq!(visible_keys(1, 2, 5, true), 5);
    assert_eq!(visible_keys(0, 5, 2, true), 0); // more queries than keys: the first see none
    assert_eq!(visible_keys(3, 5, 2, true), 1);
    assert_eq!(visible_keys(4, 5, 2, true), 2);
    assert_eq!(visible_keys(0, 5, 2, false), 2);

    // The whole-call reference agrees with the row reference and lays rows out [b, h, seq_q].
    let p = Problem::cross(2, 3, 5, 4, 4);
    let inputs = Inputs::random(p, DType::F32, 11);
    let (out, lse) = inputs.reference(true, Some(0.7));
    assert_eq!(out.len(), 2 * 3 * 5 * 4);
    assert_eq!(lse.len(), 2 * 3 * 5);
    let widen = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
    let bh = 4; // batch 1, head 1
    let (q, k, v) = (widen(&inputs.q), widen(&inputs.k), widen(&inputs.v));
    let i = 3;
    let (row, row_lse) = reference_row(
        &q[(bh * 5 + i) * 4..(bh * 5 + i + 1) * 4],
        &k[bh * 4 * 4..],
        &v[bh * 4 * 4..],
        4,
        visible_keys(i, 5, 4, true),
        0.7,
    );
    assert_eq!(row, out[(bh * 5 + i) * 4..(bh * 5 + i + 1) * 4]);
    assert_eq!(row_lse, lse[bh * 5 + i]);
    assert_eq!(lse[bh * 5], f64::NEG_INFINITY); // row 0 of 5 queries over 4 keys sees none

    // Inputs: seeded, reproducible, never zero, different across seeds and tensors.
    let a = Inputs::random(p, DType::F32, 1);
    let b = Inputs::random(p, DType::F32, 1);
    let c = Inputs::random(p, DType::F32, 2);
    assert_eq!(a.q, b.q);
    assert_ne!(a.q, c.q);
    assert_ne!(a.q[..16], a.k[..16]);
    assert!(a.q.iter().chain(&a.k).chain(&a.v).all(|&x| x != 0.0));

    // NaN never passes.
    let e = common::error(&[1.0, f64::NAN], &[1.0, 2.0], 1);
    assert!(!e.finite() && e.relative.is_infinite() && e.max_abs.is_infinite());
    // The worst row is not diluted by the others.
    let e = common::error(&[1.0, 1.0, 1.0, 1.1], &[1.0, 1.0, 1.0, 1.0], 1);
    assert!((e.row_relative - 0.1).abs() < 1e-9 && e.relative < 0.06);

    // The emulated low-precision unfused attention: exact in f32 for one key, and within a few
    // bf16 roundings of the f64 reference.
    let p = Problem::cross(1, 2, 9, 40, 16);
    let inputs = Inputs::random(p, DType::BF16, 12);
    let (reference, _) = inputs.reference(true, None);
    let unfused = common::unfused_attention(&inputs, true, None);
    let e = common::error(&unfused, &reference, 16);
    let u = common::unit_roundoff(DType::BF16);
    assert!(
        e.finite() && e.relative > 0.0 && e.relative < 4.0 * u,
        "{e}"
    );
    let single = common::unfused_row(&[0.5; 4], &[1.0; 4], &[0.25, -3.0], 2, 1, 0.5, DType::F32);
    assert_eq!(single, vec![0.25, -3.0]);
}

/// Self-attention at lengths around the block sizes, head dim 64, with and without the mask.
#[test]
fn self_attention_head_dim_64() {
    let problems = [
        Problem::square(1, 1, 1, 64),
        Problem::square(2, 3, 7, 64),
        Problem::square(1, 2, 63, 64),
        Problem::square(2, 1, 64, 64),
        Problem::square(1, 3, 65, 64),
        Problem::square(1, 2, 200, 64),
    ];
    check_all(&cases(&problems, 100), Expect::Portable);
}

/// Different query and key lengths both ways (the causal mask aligned bottom-right: with more
/// queries than keys the first rows see no key and must be 0), head dim 64.
#[test]
fn cross_lengths_head_dim_64() {
    let problems = [
        Problem::cross(1, 2, 7, 65, 64),
        Problem::cross(2, 1, 65, 7, 64),
        Problem::cross(1, 1, 1, 200, 64),
        Problem::cross(1, 1, 200, 1, 64),
        Problem::cross(1, 2, 64, 65, 64),
        Problem::cross(3, 1, 65, 64, 64),
    ];
    check_all(&cases(&problems, 200), Expect::Portable);
}

/// Head dim 128, the other size the tensor cores serve.
#[test]
fn head_dim_128() {
    let problems = [
        Problem::square(1, 2, 65, 128),
        Problem::cross(1, 1, 7, 65, 128),
        Problem::cross(2, 1, 65, 7, 128),
        Problem::square(1, 1, 200, 128),
    ];
    check_all(&cases(&problems, 300), Expect::Portable);
}

/// An explicit scale (small, and large enough to make the softmax sharp); several seeds.
#[test]
fn explicit_scale_and_seeds() {
    let mut all = Vec::new();
    for seed in 400..403 {
        for (causal, scale) in [(true, 0.3), (false, 2.0)] {
            all.push(Case {
                problem: Problem::square(1, 2, 63, 64),
                causal,
                scale: Some(scale),
                seed,
            });
        }
    }
    check_all(&all, Expect::Portable);
}

/// Head dims the fused kernel does not serve (above 256) take Burn's fallback and are still
/// right; head dim 256, the widest the portable tile unrolls, runs it; other head dims are right
/// whichever path they take.
#[test]
fn other_head_dims() {
    let fallback = cases(&[Problem::square(1, 2, 20, 288)], 500);
    check_all(&fallback, Expect::Fallback);
    let widest = cases(&[Problem::cross(1, 2, 37, 20, 256)], 505);
    check_all(&widest, Expect::Portable);
    let any = cases(&[Problem::cross(1, 2, 33, 40, 48)], 510);
    check_all(&any, Expect::Any);
}

/// Head dims the tensor-core tile runs zero-padded (80, 160, 192, 192/128 and 48; on CUDA,
/// `forward_cuda`), padded here on the portable tile by the testing hook, which holds for this
/// thread only: the scale stays that of the unpadded head dim and the padded output columns are
/// dropped.
#[test]
fn padded_head_dims() {
    let _padded = burn_flash::testing::pad_head_dims();
    check_all(
        &cases(&common::padded_head_dim_problems(), 520),
        Expect::Padded,
    );
}

/// The log-sum-exp the backward will need, through `flash_attention_with_lse`: natural log, per
/// row, `-inf` for rows that see no key.
#[test]
fn log_sum_exp_rows() {
    let device = Device::wgpu(Default::default());
    burn_flash::testing::poison_outputs(true);
    let mut failures = Vec::new();
    let cases = [
        (Problem::cross(1, 2, 65, 7, 64), true, 600),
        (Problem::cross(2, 1, 63, 200, 64), false, 601),
        (Problem::cross(1, 1, 7, 65, 64), true, 602),
    ];
    for (problem, causal, seed) in cases {
        let inputs = Inputs::random(problem, DType::F32, seed);
        let [q, k, v] = inputs.to_device(&device);
        let options = FlashAttentionOptions::new().with_causal(causal);
        let plan = flash_attention_plan(&q, &k, &v, options).unwrap();
        assert_eq!(plan, FlashAttentionPlan::Fused(TilePath::Portable));
        let (out, lse) = flash_attention_with_lse(q, k, v, options);
        assert_eq!(lse.dtype(), DType::F32);
        assert_eq!(lse.dims(), [problem.batch, problem.heads, problem.seq_q]);
        let (ref_out, ref_lse) = inputs.reference(causal, None);
        let out_err = error(&to_host(out), &ref_out, problem.value_dim);
        let lse_err = lse_error(&to_host(lse), &ref_lse);
        eprintln!("lse {problem} causal {causal}: output {out_err}; lse {lse_err}");
        // lse = m + ln(l) with |m| ~ 10 at most here: absolute f32 error ~1e-6.
        if !(out_err.finite() && out_err.relative <= TOLERANCE) {
            failures.push(format!("{problem} causal {causal}: output {out_err}"));
        }
        if !(lse_err.finite() && lse_err.max_abs <= TOLERANCE) {
            failures.push(format!("{problem} causal {causal}: lse {lse_err}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
