//! The fused forward on a CUDA device (`Device::cuda`) against the f64 CPU reference of `common`.
//!
//! bf16/f16 follow the FlashAttention test rule (DESIGN.md, section 5): on the same rounded
//! inputs, the fused output's error against the f64 reference is at most twice the error of an
//! unfused attention computed in the same dtype, on three measures (global relative, worst row,
//! max abs), plus an absolute sanity bound; NaN never passes. The unfused baseline is Burn's own
//! `attention_fallback` on the FlashAttention-2 benchmark shapes. On the small edge-case shapes it
//! is `common::unfused_attention`, the same steps emulated on the CPU with the dtype's rounding
//! after each: running Burn's fallback there would autotune its matmuls for every odd length
//! (15-50 s each on an H100) and make this file take many minutes.
//!
//! f32 inputs (the portable tile on CUDA) are held to the fixed f32 tolerance of `forward_wgpu`.
//!
//! On Burn 0.23 every tensor carries its dtype and every CubeCL runtime is one backend: the bf16,
//! f16 and f32 cases run on the same `Device::cuda` (where Burn 0.21 had `Cuda<bf16>` and `Cuda`),
//! each tensor created in the case's dtype.
//!
//! Each test first checks that a CUDA device answers; without one it prints
//! `skipping: no CUDA device (...)` and passes, unless `BURN_FLASH_REQUIRE_CUDA` is set (do set it
//! on the GPU machine, so a broken driver setup cannot pass silently). Run with `--nocapture` to
//! see every case's errors and times. The first run on a machine spends minutes in Burn's
//! autotune for the fallback baseline; the results are cached under `target/` (CubeCL's
//! autotune cache, found from the working directory) and later runs are faster.

#![cfg(feature = "cuda")]

use crate::common;

use std::io::Write;
use std::time::Instant;

use burn::tensor::{DType, Device, Distribution, Tensor};
use burn_flash::{
    FlashAttentionOptions, FlashAttentionPlan, FlashAttentionProblem, TilePath, flash_attention,
    flash_attention_plan, flash_attention_support,
};
use common::cuda::{cuda_device, has_tensor_cores, hopper_forward};
use common::{
    Error, Inputs, Problem, Spec, error, masked_rows, reference_row, to_host, unfused_attention,
    unfused_row, unit_roundoff, visible_keys,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Tolerance of f32 results, as in `forward_wgpu` (see the reasoning there).
const F32_TOLERANCE: f64 = 1e-4;

/// Slack added to the "twice the fallback's error" rule, so that a fallback error of exactly 0
/// (e.g. one key per row: both give `v` exactly) does not demand an exact 0 of f32 arithmetic.
const RULE_FLOOR: f64 = 1e-6;

/// The path bf16/f16 inputs of this head dim must take on this device.
fn expected_plan(device: &Device, dtype: DType, problem: &Problem) -> Expect {
    match dtype {
        DType::F32 => Expect::Tile(TilePath::Portable),
        _ if !has_tensor_cores(device, dtype) => {
            let _ = writeln!(
                std::io::stderr(),
                "note: this GPU has no SM80 tensor-core support for {dtype:?}; expecting the \
                 portable tile"
            );
            Expect::Tile(TilePath::Portable)
        }
        _ if problem.head_dim.max(problem.value_dim) <= 256 => {
            Expect::Plan(common::expected_fused(TilePath::TensorCore, problem))
        }
        _ => Expect::Fallback,
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Expect {
    Tile(TilePath),
    Plan(FlashAttentionPlan),
    Fallback,
}

impl Expect {
    fn accepts(&self, plan: &FlashAttentionPlan) -> bool {
        match self {
            Expect::Tile(tile) => common::plan_is(plan, &FlashAttentionPlan::Fused(*tile)),
            Expect::Plan(expected) => common::plan_is(plan, expected),
            Expect::Fallback => matches!(plan, FlashAttentionPlan::Fallback(_)),
        }
    }

    /// What the backend trait alone (no padding) must answer.
    fn unpadded(self) -> Self {
        match self {
            Expect::Plan(FlashAttentionPlan::FusedPadded { .. }) => Expect::Fallback,
            Expect::Plan(FlashAttentionPlan::Fused(tile)) => Expect::Tile(tile),
            other => other,
        }
    }
}

/// The accuracy rule. bf16/f16: with a baseline, the fused error at most twice the baseline's
/// on each measure (global relative, worst row, max abs); always, a sanity bound of a few units
/// of roundoff of the dtype. f32: the fixed tolerance. Non-finite values never pass.
fn judge(dtype: DType, fused: &Error, baseline: Option<&Error>) -> Result<(), String> {
    if !fused.finite() {
        return Err(format!(
            "{} non-finite values in the output",
            fused.non_finite
        ));
    }
    if dtype == DType::F32 {
        let bound = F32_TOLERANCE;
        return if fused.relative <= bound && fused.max_abs <= bound * fused.ref_max.max(1.0) {
            Ok(())
        } else {
            Err(format!("error above the f32 tolerance {bound:e}"))
        };
    }
    let mut failures = Vec::new();
    if let Some(base) = baseline {
        if !base.finite() {
            return Err("the unfused baseline is not finite: nothing to compare with".into());
        }
        let twice = |fused: f64, base: f64| fused <= 2.0 * base + RULE_FLOOR;
        if !twice(fused.relative, base.relative) {
            failures.push("relative error above twice the unfused one");
        }
        if !twice(fused.row_relative, base.row_relative) {
            failures.push("worst-row error above twice the unfused one");
        }
        if !twice(fused.max_abs, base.max_abs) {
            failures.push("max abs error above twice the unfused one");
        }
    }
    // Sanity: rounding the output alone costs up to u relative; a handful of u is the most a
    // correct f32-accumulating kernel can lose.
    let u = unit_roundoff(dtype);
    if fused.relative > 4.0 * u || fused.max_abs > 8.0 * u * fused.ref_max.max(1.0) {
        failures.push("error above the sanity bound (4u relative, 8u·max|ref| max abs)");
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("; "))
    }
}

/// Count NaN and infinite values of a whole device tensor (cheap: on the device).
fn count_non_finite(tensor: Tensor<4>) -> i64 {
    let bad = tensor.clone().is_nan().int().sum() + tensor.is_inf().int().sum();
    bad.into_data().iter::<i64>().next().unwrap_or(-1)
}

/// One small call (see [`small_cases`]).
#[derive(Clone, Copy, Debug)]
struct Case {
    problem: Problem,
    spec: Spec,
    /// `None`: `1 / sqrt(head_dim)`.
    scale: Option<f64>,
    seed: u64,
}

impl core::fmt::Display for Case {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let Case {
            problem,
            spec,
            scale,
            seed,
        } = self;
        write!(f, "{problem} {spec} scale {scale:?} seed {seed}")
    }
}

/// The shapes of `forward_wgpu`: lengths around the block sizes, both length orders, batch and
/// head counts, head dims 64 and 128, then the other tensor-core head dims
/// ([`common::head_dim_problems`]) and (with `other_head_dim`) those the tensor-core tile runs
/// zero-padded ([`common::padded_head_dim_problems`]); each plain and causal. Then the features of
/// `features_wgpu` at tensor-core sizes (see [`common::feature_cases`]).
fn small_cases(first_seed: u64, other_head_dim: bool) -> Vec<Case> {
    let problems = [
        Problem::square(1, 1, 1, 64),
        Problem::square(2, 3, 7, 64),
        Problem::square(1, 2, 63, 64),
        Problem::square(2, 1, 64, 64),
        Problem::square(1, 3, 65, 64),
        Problem::square(1, 2, 200, 64),
        Problem::cross(1, 2, 7, 65, 64),
        Problem::cross(2, 1, 65, 7, 64),
        Problem::cross(1, 1, 1, 200, 64),
        Problem::cross(1, 1, 200, 1, 64),
        Problem::cross(1, 2, 64, 65, 64),
        Problem::cross(3, 1, 65, 64, 64),
        Problem::square(1, 2, 65, 128),
        Problem::cross(1, 1, 7, 65, 128),
        Problem::cross(2, 1, 65, 7, 128),
        Problem::square(1, 2, 200, 128),
    ];
    let padded = if other_head_dim {
        common::padded_head_dim_problems()
    } else {
        Vec::new()
    };
    problems
        .iter()
        .chain(&common::head_dim_problems())
        .chain(&padded)
        .flat_map(|&problem| [false, true].map(|causal| (problem, Spec::from(causal))))
        .chain(common::feature_cases())
        .enumerate()
        .map(|(index, (problem, spec))| Case {
            problem,
            spec,
            scale: None,
            seed: first_seed + index as u64,
        })
        .collect()
}

/// How a small case reaches the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    /// The public API on a `Device::cuda` tensor: Burn's fusion backend, the kernels run from
    /// the fusion stream's custom operation.
    Api,
    /// The backend extension trait called on Burn's bare CubeCL backend (`CubeBackend`, without
    /// fusion) with tensors of the same device (see [`bare`]).
    Bare,
}

/// Run one small case on `device` in `dtype` by `route`: the plan, and the output against the
/// f64 reference of the same rounded inputs (and, for bf16/f16, the emulated unfused baseline).
fn check_small(device: &Device, case: Case, dtype: DType, route: Route) -> Result<(), String> {
    burn_flash::testing::poison_outputs(true);
    let started = Instant::now();
    let Case {
        problem,
        spec,
        scale,
        seed,
    } = case;
    let inputs = Inputs::random(problem, dtype, seed);
    let options = spec.options(scale);
    let expect = expected_plan(device, dtype, &problem);

    let (plan, fused) = match route {
        Route::Api => {
            let [q, k, v] = inputs.to_device(device);
            let plan = flash_attention_plan(&q, &k, &v, options)
                .map_err(|e| format!("{dtype:?} {case}: refused: {e}"))?;
            if !expect.accepts(&plan) {
                return Err(format!(
                    "{dtype:?} {case}: plan is {plan}, expected {expect:?}"
                ));
            }
            let out = flash_attention(q, k, v, options);
            if out.dtype() != dtype || out.dims() != problem.out_dims() {
                return Err(format!(
                    "{dtype:?} {case}: output is {:?} {:?}",
                    out.dtype(),
                    out.dims()
                ));
            }
            (plan, to_host(out))
        }
        Route::Bare => {
            // What a caller of the backend trait asks first (the public API's plan asks the same).
            let problem_dims = FlashAttentionProblem::new(
                problem.q_dims(),
                problem.k_dims(),
                problem.v_dims(),
                dtype,
                spec.causal,
            );
            let plan = match flash_attention_support(device, &problem_dims) {
                Ok(tile) => FlashAttentionPlan::Fused(tile),
                Err(reason) => FlashAttentionPlan::Fallback(reason),
            };
            // The backend trait runs the kernels' own head dims; the API pads the others.
            let expect = expect.clone().unpadded();
            if !expect.accepts(&plan) {
                return Err(format!(
                    "{dtype:?} {case}: support is {plan}, expected {expect:?}"
                ));
            }
            if !plan.is_fused() {
                // Burn 0.21's bare backend ran Burn's `attention_fallback` here; the backend
                // trait has nothing to run, and the fallback is covered through the API.
                eprintln!(
                    "{dtype:?} {case}: {plan}: not run on the bare backend (the fused kernels \
                     do not take it)"
                );
                return Ok(());
            }
            let (out_dtype, out_dims, out) = bare::forward(device, &inputs, options);
            if out_dtype != dtype || out_dims != problem.out_dims() {
                return Err(format!(
                    "{dtype:?} {case}: output is {out_dtype:?} {out_dims:?}"
                ));
            }
            (plan, out)
        }
    };
    let call_time = started.elapsed();
    let (reference, _) = inputs.reference(spec, scale);
    let fused_err = error(&fused, &reference, problem.value_dim);
    // The unfused baseline of the rule, for fused low-precision runs (a fallback run is the
    // unfused attention itself: only the sanity bound applies).
    let baseline = (dtype != DType::F32 && plan.is_fused()).then(|| {
        let unfused = unfused_attention(&inputs, spec, scale);
        error(&unfused, &reference, problem.value_dim)
    });
    let verdict = judge(dtype, &fused_err, baseline.as_ref());
    let base_text = baseline.map_or(String::new(), |base| format!("; emulated unfused {base}"));
    // The time includes compiling the kernel on its first use.
    eprintln!(
        "{dtype:?} {case}: {plan}: {fused_err}{base_text}; call {call_time:.2?}{}",
        if verdict.is_ok() { "" } else { " FAILED" }
    );
    verdict.map_err(|why| format!("{dtype:?} {case}: {plan}: {why}: {fused_err}{base_text}"))?;

    let dv = problem.value_dim;
    for row in masked_rows(&problem, spec) {
        if fused[row * dv..(row + 1) * dv].iter().any(|&x| x != 0.0) {
            return Err(format!(
                "{dtype:?} {case}: row {row} sees no key but is not 0"
            ));
        }
    }
    Ok(())
}

/// The fused forward called through the backend extension trait on Burn's bare CubeCL backend.
///
/// Burn 0.21 had a backend type per runtime, and `CubeBackend<CudaRuntime, ..>` without `Fusion`
/// ran the public API on unfused tensors. Burn 0.23 has one CubeCL backend for every runtime
/// (re-exported as `burn::backend::wgpu::CubeBackend`, CUDA's as much as wgpu's), and a
/// `Device::cuda` tensor always runs on it through `Fusion` (the `fusion` feature). The nearest
/// equivalent is this: the inputs as `CubeBackend` tensors of the same CUDA device, the forward
/// of `<CubeBackend as FlashAttentionBackend>`, the output read back, without the fusion stream.
mod bare {
    use burn::backend::ops::FloatTensorOps;
    use burn::backend::tensor::FloatTensor;
    use burn::backend::wgpu::CubeBackend;
    use burn::backend::{CubeDevice, DispatchDevice, TensorMetadata};
    use burn::tensor::{DType, Device, TensorData, read_sync};
    use burn_flash::{FlashAttentionBackend, FlashAttentionOptions, ScoreInputs};

    use crate::common::Inputs;

    /// The CubeCL device under a (non-autodiff) `Device`.
    fn cube_device(device: &Device) -> CubeDevice {
        match device.clone().without_autodiff().as_dispatch() {
            DispatchDevice::Cube(cube) => cube.clone(),
            #[allow(unreachable_patterns)]
            other => panic!("not a CubeCL device: {other:?}"),
        }
    }

    /// A `CubeBackend` tensor of `dtype` holding `values` (representable in `dtype`).
    fn from_host(
        values: &[f32],
        dims: [usize; 4],
        dtype: DType,
        device: &CubeDevice,
    ) -> FloatTensor<CubeBackend> {
        let data = match dtype {
            DType::F32 => TensorData::new(values.to_vec(), dims),
            DType::F16 => TensorData::new(
                values.iter().map(|&x| half::f16::from_f32(x)).collect(),
                dims,
            ),
            DType::BF16 => TensorData::new(
                values.iter().map(|&x| half::bf16::from_f32(x)).collect(),
                dims,
            ),
            other => panic!("unsupported test dtype {other:?}"),
        };
        let tensor = CubeBackend::float_from_data(data, device);
        assert_eq!(
            tensor.dtype(),
            dtype,
            "the tensor was not created in {dtype:?}"
        );
        tensor
    }

    /// The output of the fused forward on `inputs`: its dtype, dims and values widened to f64.
    pub fn forward(
        device: &Device,
        inputs: &Inputs,
        options: FlashAttentionOptions,
    ) -> (DType, Vec<usize>, Vec<f64>) {
        let device = cube_device(device);
        let p = &inputs.problem;
        let tensor = |values: &[f32], dims| from_host(values, dims, inputs.dtype, &device);
        let forward = <CubeBackend as FlashAttentionBackend>::flash_attention_forward(
            tensor(&inputs.q, p.q_dims()),
            tensor(&inputs.k, p.k_dims()),
            tensor(&inputs.v, p.v_dims()),
            ScoreInputs::Neither,
            options,
        );
        let output = forward.output;
        let (dtype, dims) = (output.dtype(), output.shape().to_vec());
        let data = read_sync(CubeBackend::float_into_data(output))
            .unwrap_or_else(|error| panic!("reading the bare backend's output: {error:?}"));
        (dtype, dims, data.iter::<f64>().collect())
    }
}

fn check_all_small(test: &str, dtype: DType, first_seed: u64, route: Route) {
    check_cases(
        test,
        dtype,
        &small_cases(first_seed, dtype != DType::F16),
        route,
    );
}

fn check_cases(test: &str, dtype: DType, cases: &[Case], route: Route) {
    let Some(device) = cuda_device(test) else {
        return;
    };
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|&case| check_small(&device, case, dtype, route).err())
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// bf16 tensors on `Device::cuda` (Burn 0.21: on `Cuda<bf16>`, whose default float was bf16).
#[test]
fn small_shapes_bf16() {
    check_all_small("small_shapes_bf16", DType::BF16, 1000, Route::Api);
}

/// Decoding against a cache in bf16 on the tensor-core tile: one new query per sequence or a
/// chunk of four (causal bottom-right), 32 query heads over 8 or 4 key/value heads at head dim
/// 128, caches of 1 to 4100 keys (ragged against the key blocks). The plan takes 16-row blocks
/// of one plane, keys split where the row blocks are fewer than the SMs (down to a key block a
/// split), whole for the 160 row blocks of the fifth case, and 32-key stages for the 512 of the
/// last (on 132 SMs more than one wave of 64-key cubes, one of 32-key ones).
#[test]
fn decode_shapes_bf16() {
    let problems = [
        Problem::cross(2, 32, 1, 1, 128).grouped(8),
        Problem::cross(2, 32, 1, 1000, 128).grouped(8),
        Problem::cross(1, 32, 1, 4100, 128).grouped(4),
        Problem::cross(3, 32, 4, 2049, 128).grouped(8),
        Problem::cross(5, 32, 1, 300, 128),
        Problem::cross(16, 32, 1, 70, 128),
    ];
    let cases: Vec<Case> = problems
        .iter()
        .enumerate()
        .map(|(index, &problem)| Case {
            problem,
            spec: Spec::from(true),
            scale: None,
            seed: 4000 + index as u64,
        })
        .collect();
    check_cases("decode_shapes_bf16", DType::BF16, &cases, Route::Api);
}

/// f16 tensors on `Device::cuda`; every tensor-core head dim (bf16 also covers the fallback of
/// head dim 48).
#[test]
fn small_shapes_f16() {
    check_all_small("small_shapes_f16", DType::F16, 2000, Route::Api);
}

/// bf16 on the bare `CubeBackend` (no fusion), which the fusion backend of `Device::cuda` wraps:
/// the same kernels, reached without `Fusion`'s custom operation (see [`bare`]).
#[test]
fn small_shapes_bf16_bare_backend() {
    check_all_small(
        "small_shapes_bf16_bare_backend",
        DType::BF16,
        4000,
        Route::Bare,
    );
}

/// The softcap at the edge of the forward's bounded max (`features_wgpu::softcap_at_the_bound`
/// on the tensor cores): a scale that pushes most scores past the cap and few keys, so that
/// some rows see only scores near `−cap`. bf16 takes the bounded max at cap 33 (probabilities
/// near 2⁻⁹⁵) and the running max at 50; f16, whose probabilities would underflow against the
/// bound, takes the running max at both.
#[test]
fn softcap_at_the_bound() {
    let cases: Vec<Case> = [
        (Problem::cross(1, 2, 130, 3, 64), false, 33.0),
        (Problem::cross(1, 2, 130, 3, 64), false, 50.0),
        (Problem::cross(2, 2, 150, 200, 128), true, 33.0),
    ]
    .into_iter()
    .enumerate()
    .map(|(index, (problem, causal, cap))| Case {
        problem,
        spec: Spec {
            causal,
            softcap: Some(cap),
            ..Spec::default()
        },
        scale: Some(10.0),
        seed: 5000 + index as u64,
    })
    .collect();
    check_cases("softcap_at_the_bound", DType::BF16, &cases, Route::Api);
    check_cases("softcap_at_the_bound", DType::F16, &cases, Route::Api);
}

/// f32 inputs are accepted on CUDA and run the portable tile.
#[test]
fn small_shapes_f32() {
    check_all_small("small_shapes_f32", DType::F32, 3000, Route::Api);
}

/// Query rows compared at benchmark sizes: the block edges (16, 32, 64, 128 rows) at both
/// ends and the middle, plus `extra` seeded random rows.
fn sample_rows(n: usize, extra: usize, seed: u64) -> Vec<usize> {
    let mut rows: Vec<usize> = [0, 1, 15, 16, 31, 32, 63, 64, 65, 127, 128]
        .into_iter()
        .flat_map(|r| [r, n.saturating_sub(r + 1), n / 2 + r])
        .filter(|&r| r < n)
        .collect();
    let mut rng = StdRng::seed_from_u64(seed);
    rows.extend((0..extra).map(|_| rng.random_range(0..n)));
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// One FlashAttention-2 benchmark shape (16k tokens, hidden 2048: `b = 16384 / n`,
/// `h = 2048 / d`), compared with the f64 reference on sampled heads and rows (the full
/// reference would take minutes of CPU) by the 2× rule against the unfused attention emulated
/// in the same dtype; the whole fused output is checked for NaN/inf on the device.
fn check_benchmark_shape(
    device: &Device,
    dtype: DType,
    head_dim: usize,
    n: usize,
    causal: bool,
    seed: u64,
) -> Result<(), String> {
    burn_flash::testing::poison_outputs(true);
    let started = Instant::now();
    let (batch, heads) = ((16384 / n).max(1), 2048 / head_dim);
    let label = format!("{dtype:?} b {batch} h {heads} n {n} d {head_dim} causal {causal}");
    device.seed(seed);
    let dims = [batch, heads, n, head_dim];
    let [q, k, v] =
        [(); 3].map(|_| Tensor::<4>::random(dims, Distribution::Normal(0.0, 1.0), (device, dtype)));
    let options = FlashAttentionOptions::new().with_causal(causal);
    let plan = flash_attention_plan(&q, &k, &v, options).map_err(|e| format!("{label}: {e}"))?;
    let expect = match expected_plan(device, dtype, &Problem::square(batch, heads, n, head_dim)) {
        Expect::Plan(FlashAttentionPlan::Fused(TilePath::TensorCore))
            if hopper_forward(device, head_dim, n, causal) =>
        {
            Expect::Plan(FlashAttentionPlan::FusedWarpgroup)
        }
        other => other,
    };
    if !expect.accepts(&plan) {
        return Err(format!("{label}: plan is {plan}, expected {expect:?}"));
    }

    let fused = flash_attention(q.clone(), k.clone(), v.clone(), options);
    let non_finite = count_non_finite(fused.clone());
    if non_finite != 0 {
        return Err(format!(
            "{label}: {non_finite} NaN/inf values in the fused output"
        ));
    }
    let fused_time = started.elapsed();
    let scale = 1.0 / (head_dim as f64).sqrt();
    let rows = sample_rows(n, 96, seed);
    let mut sampled_heads = vec![(0, 0), (batch - 1, heads - 1), (batch / 2, heads / 3)];
    sampled_heads.dedup();
    let head = |t: &Tensor<4>, (b, h): (usize, usize)| t.clone().slice([b..b + 1, h..h + 1, 0..n]);
    let ours: Vec<[Vec<f64>; 4]> = sampled_heads
        .iter()
        .map(|&bh| [&q, &k, &v, &fused].map(|t| to_host(head(t, bh))))
        .collect();

    let (mut got, mut emulated, mut reference) = (Vec::new(), Vec::new(), Vec::new());
    for [qh, kh, vh, fh] in &ours {
        let narrow = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<f32>>();
        let (qs, ks, vs) = (narrow(qh), narrow(kh), narrow(vh));
        for &i in &rows {
            let row = i * head_dim..(i + 1) * head_dim;
            let visible = visible_keys(i, n, n, causal);
            let (expected, _) = reference_row(&qh[row.clone()], kh, vh, head_dim, visible, scale);
            reference.extend(expected);
            emulated.extend(unfused_row(
                &qs[row.clone()],
                &ks,
                &vs,
                head_dim,
                visible,
                scale,
                dtype,
            ));
            got.extend_from_slice(&fh[row]);
        }
    }
    let fused_err = error(&got, &reference, head_dim);
    // The baseline is the unfused attention emulated on the host in the same dtype, as on the
    // small shapes: Burn 0.23.0-pre.1's bf16 `attention_fallback` gave the same errors to four
    // digits wherever it ran on the H200 (2026-11-30), but CUDA refuses its launches on the
    // plain shapes there (docs/gpt.md, "the TMA refusal") after minutes of autotuning.
    let baseline = error(&emulated, &reference, head_dim);
    let verdict = judge(dtype, &fused_err, Some(&baseline));
    eprintln!(
        "{label}: {plan}: fused {fused_err}; emulated unfused {baseline}; fused/baseline \
         relative {:.2}; fused call {fused_time:.2?}, total {:.2?}{}",
        fused_err.relative / baseline.relative,
        started.elapsed(),
        if verdict.is_ok() { "" } else { " FAILED" }
    );
    verdict.map_err(|why| format!("{label}: {why}: fused {fused_err}; emulated unfused {baseline}"))
}

fn check_benchmark_shapes(test: &str, dtype: DType, head_dim: usize, lengths: &[usize]) {
    let Some(device) = cuda_device(test) else {
        return;
    };
    let mut failures = Vec::new();
    let mut count = 0;
    for (index, &n) in lengths.iter().enumerate() {
        for causal in [false, true] {
            count += 1;
            let seed = 4000 + 10 * index as u64 + causal as u64;
            if let Err(failure) = check_benchmark_shape(&device, dtype, head_dim, n, causal, seed) {
                failures.push(failure);
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {count} shapes failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// FlashAttention-2 benchmark shapes in bf16, head dim 64, n 512 to 4096, causal and not.
#[test]
fn benchmark_shapes_bf16_d64() {
    check_benchmark_shapes(
        "benchmark_shapes_bf16_d64",
        DType::BF16,
        64,
        &[512, 1024, 2048, 4096],
    );
}

/// FlashAttention-2 benchmark shapes in bf16, head dim 128, n 512 to 4096, causal and not.
#[test]
fn benchmark_shapes_bf16_d128() {
    check_benchmark_shapes(
        "benchmark_shapes_bf16_d128",
        DType::BF16,
        128,
        &[512, 1024, 2048, 4096],
    );
}

/// FlashAttention-2 benchmark shapes in bf16, head dim 256 (8 heads), n 1024 and 2048.
#[test]
fn benchmark_shapes_bf16_d256() {
    check_benchmark_shapes(
        "benchmark_shapes_bf16_d256",
        DType::BF16,
        256,
        &[1024, 2048],
    );
}

/// The same in f16, at one length.
#[test]
fn benchmark_shapes_f16() {
    check_benchmark_shapes("benchmark_shapes_f16", DType::F16, 64, &[1024]);
    check_benchmark_shapes("benchmark_shapes_f16", DType::F16, 128, &[1024]);
}
