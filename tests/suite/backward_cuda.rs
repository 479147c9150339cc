//! The fused backward on an autodiff CUDA device (`Device::cuda(..).autodiff()`, bf16 and f16
//! tensors) against the f64 reference gradients of `common`, with the FlashAttention test rule of DESIGN.md
//! section 5 (see [`judge`]): on the same rounded inputs and upstream gradient, each of dq, dk
//! and dv of the fused path is at most twice as far from the f64 reference as the unfused
//! path's, and never NaN.
//!
//! The unfused baseline is `common::unfused_grads`, the unfused attention's steps emulated on
//! the CPU with the dtype's rounding after each (on the FlashAttention-2 benchmark shapes, for
//! sampled heads): Burn's fallback would autotune its matmuls for every odd length, and CUDA
//! refuses its launches on the plain benchmark shapes (docs/gpt.md, "the TMA refusal").
//!
//! On Burn 0.23 every tensor carries its dtype and every CubeCL runtime is one backend: the bf16
//! and f16 cases run on the same device (where Burn 0.21 had `Autodiff<Cuda<bf16>>` and
//! `Autodiff<Cuda>`), each tensor created in the case's dtype.
//!
//! Without a CUDA device each test prints `skipping: no CUDA device (...)` and passes, unless
//! `BURN_FLASH_REQUIRE_CUDA` is set (set it on the GPU machine).

#![cfg(feature = "cuda")]

use crate::common;

use std::time::Instant;

use burn::tensor::{DType, Device, Distribution, Tensor};
use burn_flash::{FlashAttentionPlan, TilePath, flash_attention, flash_attention_plan};
use common::cuda::{cuda_device, has_tensor_cores, has_tma, hopper_forward};
use common::{
    Error, Inputs, Problem, Spec, error, random_normal, reference_grads, round_to,
    tensor_from_host, to_host, unfused_grads, unit_roundoff,
};

/// Slack added to the "twice the baseline" rule on the global relative error so that a baseline
/// error of exactly 0 does not demand an exact 0 of f32 arithmetic.
const RULE_FLOOR: f64 = 1e-6;

/// Against gross failure only (the rule above is the criterion): a gradient that went through
/// two bf16/f16-rounded products (P or dS rounded into the second one) and a difference
/// `dP − D` that may cancel keeps its global relative error within a few units of roundoff; 16
/// is far below what one wrong block or a wrong scale produces (O(1)).
const SANITY_UNITS: f64 = 16.0;

/// FlashAttention's own slack on the max-abs rule (`dq_atol` in its tests): twice the largest
/// rounding error of `reference + 0.3` in the dtype, i.e. what rounding alone costs on a value
/// of the gradients' typical size.
fn rounding_atol(reference: &[f64], dtype: DType) -> f64 {
    let worst = reference
        .iter()
        .map(|&r| ((round_to((r + 0.3) as f32, dtype) as f64 - 0.3) - r).abs())
        .fold(0.0, f64::max);
    2.0 * worst
}

/// The rule for one gradient: max abs error at most twice the unfused one plus
/// [`rounding_atol`] (FlashAttention's test rule), global relative error at most twice the
/// unfused one (skipped when the reference is identically 0, e.g. `seq_k = 1`, where a relative
/// error has no meaning and the unfused path's 0 is an exact cancellation).
///
/// The worst-row error is printed but not judged: `D = rowsum(dO ∘ O)` is formed from the
/// stored, rounded output (as FlashAttention-2 does), which shifts every `dS` of a row by the
/// same rounding error; on rows whose gradient is small beside `|dO|·|O|` that dominates the
/// row's relative error, while the unfused path (D from the same rounded P it multiplies) does
/// not have it. Max abs bounds that error in absolute terms.
fn judge(dtype: DType, fused: &Error, base: &Error, atol: f64) -> Result<(), String> {
    if !fused.finite() {
        return Err(format!("{} non-finite values", fused.non_finite));
    }
    if !base.finite() {
        return Err("the unfused baseline is not finite: nothing to compare with".into());
    }
    let mut failures = Vec::new();
    if fused.max_abs > 2.0 * base.max_abs + atol {
        failures.push(format!(
            "max abs error above twice the unfused one + {atol:.1e}"
        ));
    }
    if fused.ref_max > 0.0 {
        if fused.relative > 2.0 * base.relative + RULE_FLOOR {
            failures.push("relative error above twice the unfused one".into());
        }
        if fused.relative > SANITY_UNITS * unit_roundoff(dtype) {
            failures.push("relative error above the sanity bound".into());
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("; "))
    }
}

/// Fused gradients of `sum(upstream ∘ attention(q, k, v))` on the autodiff `device`, after
/// checking that the fused tensor-core path (or the portable one, on a GPU without SM80 MMAs)
/// runs, or with `hopper` the Hopper forward (`common::cuda::hopper_forward`).
#[allow(clippy::too_many_arguments)]
fn fused_grads(
    device: &Device,
    label: &str,
    [q, k, v]: [Tensor<4>; 3],
    upstream: Tensor<4>,
    spec: Spec,
    expect: TilePath,
    deterministic: bool,
    hopper: bool,
) -> Result<[Tensor<4>; 3], String> {
    let [q, k, v] = [q, k, v].map(|t| t.require_grad());
    let options = spec.options(None).with_deterministic(deterministic);
    // Here a non-deterministic backward means the atomic dQ, whatever the shape's faster one.
    let _atomic = (!deterministic).then(burn_flash::testing::force_atomic_dq);
    let plan = flash_attention_plan(&q, &k, &v, options).map_err(|e| format!("{label}: {e}"))?;
    let problem = Problem::cross(1, 1, 1, 1, q.dims()[3]).with_value_dim(v.dims()[3]);
    let expected = if hopper {
        FlashAttentionPlan::FusedWarpgroup
    } else {
        common::expected_fused(expect, &problem)
    };
    if !common::plan_is(&plan, &expected) {
        return Err(format!("{label}: plan is {plan}, expected {expected}"));
    }
    let out = flash_attention(q.clone(), k.clone(), v.clone(), options);
    let grads = (out * upstream).sum().backward();
    let grad = |t: &Tensor<4>| {
        t.grad(&grads)
            .ok_or(format!("{label}: a gradient is missing"))
    };
    device.sync().map_err(|e| format!("{label}: {e:?}"))?;
    Ok([grad(&q)?, grad(&k)?, grad(&v)?])
}

/// The tile bf16/f16 must run on this GPU.
fn expected_tile(device: &Device, dtype: DType) -> TilePath {
    if has_tensor_cores(device, dtype) {
        TilePath::TensorCore
    } else {
        TilePath::Portable
    }
}

/// Judge dq, dk, dv; print every error.
fn judge_all(
    label: &str,
    dtype: DType,
    fused: [&[f64]; 3],
    base: [&[f64]; 3],
    reference: [&[f64]; 3],
    rows: [usize; 3],
) -> Vec<String> {
    let mut failures = Vec::new();
    for (i, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
        let fused_err = error(fused[i], reference[i], rows[i]);
        let base_err = error(base[i], reference[i], rows[i]);
        let verdict = judge(
            dtype,
            &fused_err,
            &base_err,
            rounding_atol(reference[i], dtype),
        );
        eprintln!(
            "{label}: {name}: fused {fused_err}; unfused {base_err}{}",
            if verdict.is_ok() { "" } else { " FAILED" }
        );
        if let Err(why) = verdict {
            failures.push(format!(
                "{label}: {name}: {why}: fused {fused_err}; unfused {base_err}"
            ));
        }
    }
    failures
}

/// Judge each of `fused` (dq, dk, dv of one run on `inputs` and `upstream`) against the f64
/// reference gradients of `problem` and the unfused baseline ([`judge_all`]).
fn judge_problem<const RUNS: usize>(
    label: &str,
    dtype: DType,
    problem: &Problem,
    spec: Spec,
    inputs: &Inputs,
    upstream: &[f32],
    fused: [&[Vec<f64>; 3]; RUNS],
) -> Vec<String> {
    let widen = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
    let (rq, rk, rv) = reference_grads(
        problem,
        &widen(&inputs.q),
        &widen(&inputs.k),
        &widen(&inputs.v),
        &widen(upstream),
        spec,
        None,
    );
    let (bq, bk, bv) = unfused_grads(inputs, upstream, spec, None);
    let mut failures = Vec::new();
    for (run, [dq, dk, dv]) in fused.into_iter().enumerate() {
        failures.extend(judge_all(
            &format!("{label} run {run}"),
            dtype,
            [dq, dk, dv],
            [&bq, &bk, &bv],
            [&rq, &rk, &rv],
            [problem.head_dim, problem.head_dim, problem.value_dim],
        ));
    }
    failures
}

/// Small and odd shapes at head dims 64 and 128, plain and causal.
fn small_problems() -> Vec<(Problem, Spec)> {
    both_masks(vec![
        Problem::square(1, 1, 1, 64),
        Problem::square(2, 3, 7, 64),
        Problem::square(1, 2, 63, 64),
        Problem::square(1, 3, 65, 64),
        Problem::square(1, 2, 200, 64),
        Problem::cross(1, 2, 7, 65, 64),
        Problem::cross(2, 1, 65, 7, 64),
        Problem::cross(1, 1, 1, 200, 64),
        Problem::cross(1, 1, 200, 1, 64),
        Problem::square(1, 2, 65, 128),
        Problem::cross(1, 1, 7, 65, 128),
        Problem::cross(2, 1, 65, 130, 128),
        Problem::square(1, 2, 200, 128),
    ])
}

/// Each problem plain and causal.
fn both_masks(problems: Vec<Problem>) -> Vec<(Problem, Spec)> {
    problems
        .into_iter()
        .flat_map(|p| [(p, Spec::from(false)), (p, Spec::from(true))])
        .collect()
}

/// Head dims the tensor-core tile runs zero-padded ([`common::padded_head_dim_problems`]), plain
/// and causal.
fn padded_problems() -> Vec<(Problem, Spec)> {
    both_masks(common::padded_head_dim_problems())
}

/// The gradients of `problems` against the f64 reference; `deterministic`: dQ by its own launch
/// instead of f32 atomics (forced where not the faster).
fn check_problems(
    test: &str,
    dtype: DType,
    first_seed: u64,
    deterministic: bool,
    problems: Vec<(Problem, Spec)>,
) {
    let Some(device) = cuda_device(test) else {
        return;
    };
    let device = device.autodiff();
    burn_flash::testing::poison_outputs(true);
    let expect = expected_tile(&device, dtype);
    let mut failures = Vec::new();
    for (index, (problem, spec)) in problems.into_iter().enumerate() {
        let seed = first_seed + index as u64;
        let label = format!("{dtype:?} {problem} {spec} seed {seed}");
        let started = Instant::now();
        let inputs = Inputs::random(problem, dtype, seed);
        let upstream = random_normal(problem.out_dims().iter().product(), seed ^ 0x5EED, dtype);
        let grads = fused_grads(
            &device,
            &label,
            inputs.to_device(&device),
            tensor_from_host(&upstream, problem.out_dims(), dtype, &device),
            spec,
            expect,
            deterministic,
            false,
        );
        let [dq, dk, dv] = match grads {
            Ok(grads) => grads.map(to_host),
            Err(why) => {
                failures.push(why);
                continue;
            }
        };
        eprintln!("{label}: call {:.2?}", started.elapsed());
        failures.extend(judge_problem(
            &label,
            dtype,
            &problem,
            spec,
            &inputs,
            &upstream,
            [&[dq, dk, dv]],
        ));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// bf16 gradients (Burn 0.21: on `Autodiff<Cuda<bf16>>`), small and odd shapes, dQ by atomics.
/// The head dims and the features are tests of their own ([`head_dims_bf16`],
/// [`features_bf16`]): their kernels take minutes to compile, head dim 256's backward 45–50 s
/// on the H200's host, and one process a test spreads them over its cores.
#[test]
fn small_shapes_bf16() {
    check_problems(
        "small_shapes_bf16",
        DType::BF16,
        100,
        false,
        small_problems(),
    );
}

/// [`common::head_dim_problems`] plain and causal, split where head dim 256 or values of another
/// width begin (`wide`): each half's kernels compile in about three minutes on the H200's host.
fn head_dim_cases(wide: bool) -> Vec<(Problem, Spec)> {
    let is_wide = |p: &Problem| p.head_dim.max(p.value_dim) == 256 || p.head_dim != p.value_dim;
    let problems = common::head_dim_problems()
        .into_iter()
        .filter(|p| is_wide(p) == wide)
        .collect();
    both_masks(problems)
}

/// [`small_shapes_bf16`] at head dims 32 and 96, plain and causal.
#[test]
fn head_dims_bf16() {
    check_problems(
        "head_dims_bf16",
        DType::BF16,
        130,
        false,
        head_dim_cases(false),
    );
}

/// [`small_shapes_bf16`] at head dim 256 and with values of another width than the keys.
#[test]
fn wide_and_mixed_head_dims_bf16() {
    check_problems(
        "wide_and_mixed_head_dims_bf16",
        DType::BF16,
        135,
        false,
        head_dim_cases(true),
    );
}

/// [`small_shapes_bf16`] with the features at tensor-core sizes ([`common::feature_cases`]).
#[test]
fn features_bf16() {
    let cases = common::feature_cases();
    check_problems("features_bf16", DType::BF16, 150, false, cases);
}

/// f16 tensors (Burn 0.21: on `Autodiff<Cuda>`), small and odd shapes, dQ by its deterministic
/// launch.
#[test]
fn small_shapes_f16_deterministic() {
    let problems = small_problems();
    check_problems(
        "small_shapes_f16_deterministic",
        DType::F16,
        200,
        true,
        problems,
    );
}

/// [`small_shapes_f16_deterministic`] at head dims 32 and 96.
#[test]
fn head_dims_f16_deterministic() {
    let cases = head_dim_cases(false);
    check_problems("head_dims_f16_deterministic", DType::F16, 230, true, cases);
}

/// [`small_shapes_f16_deterministic`] at head dim 256 and with values of another width.
#[test]
fn wide_and_mixed_head_dims_f16_deterministic() {
    let cases = head_dim_cases(true);
    check_problems(
        "wide_and_mixed_head_dims_f16_deterministic",
        DType::F16,
        240,
        true,
        cases,
    );
}

/// [`small_shapes_f16_deterministic`] with the features at tensor-core sizes.
#[test]
fn features_f16_deterministic() {
    let cases = common::feature_cases();
    check_problems("features_f16_deterministic", DType::F16, 260, true, cases);
}

/// bf16 gradients at head dims 80, 160, 192, 192/128 and 48, which the tensor-core tile runs
/// zero-padded: the padded columns' gradients are dropped, the others match the reference.
#[test]
fn padded_head_dims_bf16() {
    check_problems(
        "padded_head_dims_bf16",
        DType::BF16,
        300,
        false,
        padded_problems(),
    );
}

/// Forward and backward built with 64-bit indices, as tensors of more than `u32::MAX` elements
/// take them (`testing::force_wide_indices`), on small shapes: self-attention, GQA, and one
/// decoding query against 4096 keys (the forward splits the keys and packs the query heads).
#[test]
fn wide_indices_bf16() {
    let _wide = burn_flash::testing::force_wide_indices();
    let problems = [
        Problem::square(1, 2, 150, 64),
        Problem::cross(2, 4, 90, 130, 128).grouped(2),
        Problem::cross(1, 8, 1, 4096, 128).grouped(2),
    ];
    let problems = problems
        .into_iter()
        .flat_map(|p| [(p, Spec::from(false)), (p, Spec::from(true))])
        .collect();
    check_problems("wide_indices_bf16", DType::BF16, 400, false, problems);
}

/// The deterministic backward repeats bit for bit on the tensor cores; for the atomic one the
/// test prints how many dQ elements differ from it (last-bit differences of the f32 sums).
#[test]
fn deterministic_backward_repeats_bitwise() {
    let Some(device) = cuda_device("deterministic_backward_repeats_bitwise") else {
        return;
    };
    let device = device.autodiff();
    // Bits compared between calls: no dK/dV launch of the process splits meanwhile.
    let _whole = burn_flash::testing::tail_slots(0);
    let problem = Problem::cross(2, 4, 700, 1100, 128);
    let inputs = Inputs::random(problem, DType::BF16, 77);
    let upstream = random_normal(problem.out_dims().iter().product(), 78, DType::BF16);
    let expect = expected_tile(&device, DType::BF16);
    let run = |deterministic: bool| {
        let grads = fused_grads(
            &device,
            "repeat",
            inputs.to_device(&device),
            tensor_from_host(&upstream, problem.out_dims(), DType::BF16, &device),
            Spec::from(true),
            expect,
            deterministic,
            false,
        )
        .unwrap();
        grads.map(|g| to_host(g).iter().map(|x| x.to_bits()).collect::<Vec<_>>())
    };
    let first = run(true);
    for _ in 0..4 {
        assert!(
            run(true) == first,
            "the deterministic backward changed bits"
        );
    }
    let atomic = run(false);
    let differing = atomic[0]
        .iter()
        .zip(&first[0])
        .filter(|(a, b)| a != b)
        .count();
    println!(
        "atomic dQ: {differing} of {} elements differ from the deterministic dQ",
        first[0].len()
    );
}

/// At head dims 64 and 128 the forward stages K and V, and the dK/dV launch Q and dO, by tensor
/// maps where the GPU has the copy engine (SM90 and newer; 128-wide rows as two panels of 64
/// columns), by per-unit copies elsewhere or under `testing::avoid_tma`. Both stage the same
/// values, so on ragged lengths, GQA and the causal mask the deterministic training step's
/// gradients are the same bits either way; the atomic dQ's, staged by maps, are judged against
/// the f64 reference. Without the copy engine both runs take the copies.
#[test]
fn tma_staging_matches_copies() {
    let Some(device) = cuda_device("tma_staging_matches_copies") else {
        return;
    };
    let device = device.autodiff();
    // Bits compared between calls: no dK/dV launch of the process splits meanwhile.
    let _whole = burn_flash::testing::tail_slots(0);
    burn_flash::testing::poison_outputs(true);
    let dtype = DType::BF16;
    let expect = expected_tile(&device, dtype);
    let maps_expected = has_tma(&device) && expect == TilePath::TensorCore;
    let gqa = |head_dim| Problem {
        kv_heads: 2,
        ..Problem::cross(2, 4, 200, 333, head_dim)
    };
    let problems = [64, 128].map(|d| [gqa(d), Problem::square(1, 2, 129, d)]);
    let mut failures = Vec::new();
    for (index, problem) in problems.into_iter().flatten().enumerate() {
        for causal in [false, true] {
            let spec = Spec::from(causal);
            let seed = 900 + 2 * index as u64 + causal as u64;
            let label = format!("{problem} {spec} seed {seed}");
            let inputs = Inputs::random(problem, dtype, seed);
            let upstream = random_normal(problem.out_dims().iter().product(), seed ^ 0x5EED, dtype);
            let run = |deterministic: bool| {
                let grads = fused_grads(
                    &device,
                    &label,
                    inputs.to_device(&device),
                    tensor_from_host(&upstream, problem.out_dims(), dtype, &device),
                    spec,
                    expect,
                    deterministic,
                    false,
                )
                .unwrap_or_else(|why| panic!("{why}"));
                grads.map(to_host)
            };
            let before = burn_flash::testing::tma_launches();
            let mapped = run(true);
            let atomic = run(false);
            let by_maps = burn_flash::testing::tma_launches() - before;
            let copied = {
                let _copies = burn_flash::testing::avoid_tma();
                run(true)
            };
            // Two training steps: a forward and a dK/dV launch each.
            println!("{label}: {by_maps} of 4 launches staged by tensor maps");
            if maps_expected && by_maps < 4 {
                failures.push(format!(
                    "{label}: {by_maps} of 4 launches staged by tensor maps"
                ));
            }
            let bits = |g: &[Vec<f64>; 3]| {
                g.each_ref()
                    .map(|g| g.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            };
            if bits(&mapped) != bits(&copied) {
                failures.push(format!(
                    "{label}: gradients staged by maps differ from copies"
                ));
            }
            failures.extend(judge_problem(
                &label,
                dtype,
                &problem,
                spec,
                &inputs,
                &upstream,
                [&mapped, &atomic],
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The dK/dV launch's last wave split into pieces (`backward::tail`). By default the single
/// pass without a band splits over the SMs (on the H100 the last 4 of the 4096 cubes of
/// FlashAttention-2's head dim 64 shapes, a head of which `benchmark_shapes_bf16` judges);
/// here a testing hook plans every dK/dV launch for 5, 6 and 1000 cube slots, both dQ modes,
/// on ragged lengths, GQA and the causal mask (whose pieces may walk nothing). On 1000 slots
/// every launch splits all its cubes, and the deterministic one gives the same bits twice;
/// every run is judged against the f64 reference.
#[test]
fn split_tail_matches_reference() {
    let Some(device) = cuda_device("split_tail_matches_reference") else {
        return;
    };
    let device = device.autodiff();
    burn_flash::testing::poison_outputs(true);
    let dtype = DType::BF16;
    let expect = expected_tile(&device, dtype);
    let gqa = Problem {
        kv_heads: 2,
        ..Problem::cross(2, 4, 333, 200, 64)
    };
    let problems = [
        (gqa, false),
        (Problem::cross(1, 3, 129, 257, 64), false),
        (Problem::square(1, 2, 300, 128), true),
    ];
    let mut failures = Vec::new();
    for (index, (problem, causal)) in problems.into_iter().enumerate() {
        let spec = Spec::from(causal);
        let seed = 1300 + index as u64;
        let inputs = Inputs::random(problem, dtype, seed);
        let upstream = random_normal(problem.out_dims().iter().product(), seed ^ 0x5EED, dtype);
        let run = |deterministic: bool| {
            fused_grads(
                &device,
                &format!("{problem} {spec}"),
                inputs.to_device(&device),
                tensor_from_host(&upstream, problem.out_dims(), dtype, &device),
                spec,
                expect,
                deterministic,
                false,
            )
            .unwrap_or_else(|why| panic!("{why}"))
            .map(to_host)
        };
        for slots in [5, 6, 1000] {
            let _split = burn_flash::testing::tail_slots(slots);
            for deterministic in [false, true] {
                let label =
                    format!("{problem} {spec} seed {seed} {slots} slots det {deterministic}");
                let before = burn_flash::testing::tail_splits();
                let grads = run(deterministic);
                let split = burn_flash::testing::tail_splits() > before;
                println!("{label}: split {split}");
                if slots == 1000 && !split {
                    failures.push(format!("{label}: the dK/dV launch did not split"));
                }
                if slots == 1000 && deterministic {
                    let bits = |g: &[Vec<f64>; 3]| {
                        g.each_ref()
                            .map(|g| g.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                    };
                    if bits(&run(true)) != bits(&grads) {
                        failures.push(format!("{label}: a second run changed bits"));
                    }
                }
                failures.extend(judge_problem(
                    &label,
                    dtype,
                    &problem,
                    spec,
                    &inputs,
                    &upstream,
                    [&grads],
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// FlashAttention-2 benchmark shapes (16k tokens, hidden 2048) at n = 2048, bf16, against the
/// f64 reference and the unfused attention's gradients emulated in bf16 on two sampled (batch,
/// head) pairs (a full reference would take minutes of CPU); the whole fused gradients are
/// checked for NaN/inf.
#[test]
fn benchmark_shapes_bf16() {
    let Some(device) = cuda_device("benchmark_shapes_bf16") else {
        return;
    };
    let device = device.autodiff();
    burn_flash::testing::poison_outputs(true);
    let dtype = DType::BF16;
    let n = 2048;
    let mut failures = Vec::new();
    for (index, (head_dim, causal)) in [(64, false), (64, true), (128, false), (128, true)]
        .into_iter()
        .enumerate()
    {
        let (batch, heads) = (16384 / n, 2048 / head_dim);
        let label = format!("{dtype:?} b {batch} h {heads} n {n} d {head_dim} causal {causal}");
        let started = Instant::now();
        let splits = burn_flash::testing::tail_splits();
        device.seed(40 + index as u64);
        let dims = [batch, heads, n, head_dim];
        let random = || Tensor::<4>::random(dims, Distribution::Normal(0.0, 1.0), (&device, dtype));
        let (q, k, v, upstream) = (random(), random(), random(), random());
        let fused = match fused_grads(
            &device,
            &label,
            [q.clone(), k.clone(), v.clone()],
            upstream.clone(),
            Spec::from(causal),
            expected_tile(&device, dtype),
            false,
            hopper_forward(&device, head_dim, n, causal),
        ) {
            Ok(grads) => grads,
            Err(why) => {
                failures.push(why);
                continue;
            }
        };
        let fused_time = started.elapsed();
        let split = burn_flash::testing::tail_splits() > splits;
        println!("{label}: the dK/dV launch's last wave split: {split}");
        for (name, grad) in ["dq", "dk", "dv"].iter().zip(&fused) {
            let bad = grad.clone().is_nan().int().sum() + grad.clone().is_inf().int().sum();
            let bad = bad.into_scalar::<i64>();
            if bad != 0 {
                failures.push(format!("{label}: {name}: {bad} NaN/inf values"));
            }
        }

        let sampled = [(0, 0), (batch - 1, heads - 1)];
        let head = |t: &Tensor<4>, (b, h): (usize, usize)| t.clone().slice([b..b + 1, h..h + 1]);
        let problem = Problem::square(1, 1, n, head_dim);
        for &(b, h) in &sampled {
            let [hq, hk, hv, hup, fq, fk, fv] =
                [&q, &k, &v, &upstream, &fused[0], &fused[1], &fused[2]]
                    .map(|t| to_host(head(t, (b, h))));
            let (rq, rk, rv) = reference_grads(&problem, &hq, &hk, &hv, &hup, causal, None);
            // The baseline is the unfused attention's gradients emulated on the host in the
            // same dtype, as on the small shapes and the forward's benchmark shapes: Burn
            // 0.23.0-pre.1's autodiff of `attention_fallback` is refused by CUDA on the plain
            // shapes (docs/gpt.md, "the TMA refusal") after minutes of autotuning, which kept
            // this test from ending within a GPU call's ten minutes.
            let narrow = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<f32>>();
            let inputs = Inputs {
                problem,
                dtype,
                q: narrow(&hq),
                k: narrow(&hk),
                v: narrow(&hv),
            };
            let (bq, bk, bv) = unfused_grads(&inputs, &narrow(&hup), causal, None);
            failures.extend(judge_all(
                &format!("{label} head ({b}, {h})"),
                dtype,
                [&fq, &fk, &fv],
                [&bq, &bk, &bv],
                [&rq, &rk, &rv],
                [head_dim; 3],
            ));
        }
        eprintln!(
            "{label}: fused {fused_time:.2?} (first call compiles), total {:.2?}",
            started.elapsed()
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
