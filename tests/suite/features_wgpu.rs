//! The attention features beyond plain (causal) attention, forward and backward, on the portable
//! tile on an autodiff wgpu device (f32; lavapipe in CI): grouped-query attention, sliding windows
//! and bands, the softcap, and their combinations, against the f64 reference of `common` (whose
//! own gradients are checked against finite differences here too). Outputs and gradients are
//! poisoned with NaN before the kernels run.

use crate::common;

use burn::tensor::{DType, Device, Tensor};
use burn_flash::{
    FlashAttentionError, FlashAttentionOptions, FlashAttentionPlan, TilePath, flash_attention,
    flash_attention_plan, try_flash_attention,
};
use common::{
    Inputs, Problem, Spec, error, masked_rows, random_normal, reference_attention, reference_grads,
    tensor_from_host, to_host, widen,
};

/// As in `forward_wgpu.rs`: f32 rounding stays near 1e-6 on these sizes, one wrongly admitted or
/// hidden key moves a row by ~1/seq_k ≥ 5e-3. Judged on the global relative error and on every
/// element against `TOLERANCE · max(1, max |ref|)`; not row by row, since a key row of dK seen
/// by a single query of a band can have a reference norm near 0, where f32 rounding of the
/// cancelling terms alone exceeds 1e-4 of it (measured: 1.2e-4 relative, 5.6e-7 absolute).
const TOLERANCE: f64 = 1e-4;

/// One call under autodiff: the output and the three gradients against the reference. `fused`
/// says whether the fused kernels must run (else the fallback must). Returns what is wrong.
pub(crate) fn check(
    problem: Problem,
    spec: Spec,
    scale: Option<f64>,
    seed: u64,
    fused: bool,
) -> Vec<String> {
    let device = Device::wgpu(Default::default()).autodiff();
    burn_flash::testing::poison_outputs(true);
    let label = format!("{problem} {spec} scale {scale:?} seed {seed}");
    let started = std::time::Instant::now();
    let inputs = Inputs::random(problem, DType::F32, seed);
    let upstream = random_normal(problem.out_dims().iter().product(), seed ^ 0xA5, DType::F32);
    let [q, k, v] = inputs.to_device(&device).map(|t| t.require_grad());
    let options = spec.options(scale);

    let plan = flash_attention_plan(&q, &k, &v, options).unwrap();
    let expected = if fused {
        plan == FlashAttentionPlan::Fused(TilePath::Portable)
    } else {
        matches!(plan, FlashAttentionPlan::Fallback(_))
    };
    if !expected {
        return vec![format!("{label}: plan {plan}, fused expected: {fused}")];
    }

    let out = flash_attention(q.clone(), k.clone(), v.clone(), options);
    let grad_out = tensor_from_host(&upstream, problem.out_dims(), DType::F32, &device);
    let got = to_host(out.clone());
    let grads = (out * grad_out).sum().backward();

    let (q64, k64, v64) = (widen(&inputs.q), widen(&inputs.k), widen(&inputs.v));
    let (reference, _) = reference_attention(&problem, &q64, &k64, &v64, spec, scale);
    let (rq, rk, rv) = reference_grads(&problem, &q64, &k64, &v64, &widen(&upstream), spec, scale);
    let mut failures = Vec::new();
    for (name, got, reference, row) in [
        ("output", Some(got), reference, problem.value_dim),
        ("dq", q.grad(&grads).map(to_host), rq, problem.head_dim),
        ("dk", k.grad(&grads).map(to_host), rk, problem.head_dim),
        ("dv", v.grad(&grads).map(to_host), rv, problem.value_dim),
    ] {
        let Some(got) = got else {
            failures.push(format!("{label}: no {name}"));
            continue;
        };
        let err = error(&got, &reference, row);
        eprintln!("{label}: {plan}: {name} {err} ({:.1?})", started.elapsed());
        if !(err.finite()
            && err.relative <= TOLERANCE
            && err.max_abs <= TOLERANCE * err.ref_max.max(1.0))
        {
            failures.push(format!("{label}: {name} {err}, tolerance {TOLERANCE:e}"));
        }
        // Rows that see no key are exactly 0, gradients included.
        if name == "output" || name == "dq" {
            for r in masked_rows(&problem, spec) {
                if got[r * row..(r + 1) * row].iter().any(|&x| x != 0.0) {
                    failures.push(format!("{label}: {name} row {r} sees no key but is not 0"));
                }
            }
        }
    }
    failures
}

fn check_all(cases: &[(Problem, Spec, Option<f64>)], first_seed: u64, fused: bool) {
    let failures: Vec<String> = cases
        .iter()
        .enumerate()
        .flat_map(|(i, &(p, spec, scale))| check(p, spec, scale, first_seed + i as u64, fused))
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn causal() -> Spec {
    Spec::from(true)
}

fn band(causal: bool, left: Option<usize>, right: Option<usize>) -> Spec {
    Spec {
        causal,
        left,
        right,
        softcap: None,
        top_left: false,
    }
}

/// Grouped-query and multi-query attention: query heads share key/value heads; dK and dV are
/// summed over each group.
#[test]
fn grouped_query_attention() {
    check_all(
        &[
            (Problem::cross(2, 4, 37, 70, 64).grouped(2), causal(), None),
            (
                Problem::square(1, 6, 65, 64).grouped(2),
                Spec::from(false),
                None,
            ),
            (Problem::cross(1, 4, 70, 33, 32).grouped(1), causal(), None),
        ],
        100,
        true,
    );
}

/// Sliding windows and bands: across blocks (portable blocks are 32 queries by 16 keys), alone
/// and with causal masking, one-sided, diagonal only, and with more queries than keys so that
/// some rows see nothing.
#[test]
fn sliding_windows() {
    check_all(
        &[
            (
                Problem::square(1, 2, 100, 64),
                band(true, Some(20), None),
                None,
            ),
            (
                Problem::square(1, 1, 90, 64),
                band(false, Some(16), Some(3)),
                None,
            ),
            (
                Problem::square(1, 1, 70, 64),
                band(false, Some(0), Some(0)),
                None,
            ),
            (
                Problem::cross(1, 1, 50, 120, 64),
                band(false, None, Some(7)),
                None,
            ),
            (
                Problem::cross(1, 2, 90, 40, 64),
                band(true, Some(9), None),
                None,
            ),
            (
                Problem::cross(2, 1, 40, 90, 64),
                band(false, Some(33), Some(40)),
                None,
            ),
        ],
        200,
        true,
    );
}

/// Softcap of the scaled scores, with a scale large enough that the cap bends most scores.
#[test]
fn softcap() {
    let capped = |causal, cap| Spec {
        causal,
        softcap: Some(cap),
        ..Spec::default()
    };
    check_all(
        &[
            (Problem::square(1, 2, 65, 64), capped(false, 2.0), Some(0.5)),
            (Problem::cross(1, 1, 40, 75, 64), capped(true, 5.0), None),
        ],
        300,
        true,
    );
}

/// The softcap at the edge of the bounded max (`TileConfig::with_bounded_max`): three keys and a
/// scale that pushes most scores past the cap, so that about one row in eight sees only scores
/// near `−cap`, whose probabilities against the bound `cap` are near e^(−2·cap). A cap of 33
/// takes the bounded max (2⁻⁹⁵ at the extreme); 50 (Gemma-2's) is past its range and takes the
/// running max, where the bound would underflow those rows to 0.
#[test]
fn softcap_at_the_bound() {
    let case = |problem, causal, cap| {
        let spec = Spec {
            causal,
            softcap: Some(cap),
            ..Spec::default()
        };
        (problem, spec, Some(10.0))
    };
    check_all(
        &[
            case(Problem::cross(1, 2, 65, 3, 64), false, 33.0),
            case(Problem::cross(1, 2, 65, 3, 64), false, 50.0),
            case(Problem::cross(1, 1, 40, 70, 32), true, 33.0),
        ],
        310,
        true,
    );
}

/// Everything at once: GQA, a causal sliding window and a softcap, ragged lengths.
#[test]
fn combined_features() {
    let spec = Spec {
        causal: true,
        left: Some(24),
        right: None,
        softcap: Some(3.0),
        top_left: false,
    };
    check_all(
        &[(Problem::cross(1, 4, 77, 93, 64).grouped(2), spec, Some(0.3))],
        400,
        true,
    );
}

/// Burn's `CausalAlignment::TopLeft` (PyTorch's `is_causal`): the diagonal of query `i` is key
/// `i` whatever the lengths, for the causal mask and the window alike. With more keys than
/// queries the keys past the last diagonal get no gradient; with fewer, no row is empty.
#[test]
fn top_left_alignment() {
    let causal = causal().top_left();
    assert_eq!(causal.visible(1, 3, 8), [0, 1]);
    assert_eq!(causal.visible(5, 8, 3), [0, 1, 2]);
    check_all(
        &[
            (Problem::cross(1, 2, 40, 90, 64), causal, None),
            (Problem::cross(1, 2, 90, 40, 64).grouped(1), causal, None),
            (
                Problem::cross(1, 1, 50, 120, 64),
                band(false, Some(5), Some(7)).top_left(),
                None,
            ),
            (
                Problem::cross(2, 1, 70, 30, 64),
                band(true, Some(9), None).top_left(),
                None,
            ),
            (
                Problem::cross(1, 2, 33, 77, 32),
                band(true, Some(12), None).top_left(),
                Some(0.4),
            ),
        ],
        450,
        true,
    );
}

/// A head dim the fused kernels do not serve takes Burn's fallback with the same features
/// (key/value heads repeated, the window as a mask, the softcap), and autodiff through it.
#[test]
fn features_on_the_fallback() {
    let spec = Spec {
        causal: true,
        left: Some(6),
        right: None,
        softcap: Some(4.0),
        top_left: false,
    };
    check_all(
        &[
            (Problem::cross(1, 4, 19, 23, 288).grouped(2), spec, None),
            (Problem::cross(1, 2, 23, 19, 288), spec.top_left(), None),
        ],
        500,
        false,
    );
}

/// The f64 reference gradients with GQA, a band and a softcap against central finite
/// differences of the f64 reference forward.
#[test]
fn reference_gradients_match_finite_differences() {
    let spec = Spec {
        causal: false,
        left: Some(2),
        right: Some(1),
        softcap: Some(1.5),
        top_left: false,
    };
    // The band hides keys: of 7 keys, the first and last of 6 queries see 3 each.
    assert_eq!(spec.visible(0, 6, 7), [0, 1, 2]);
    assert_eq!(spec.visible(5, 6, 7), [4, 5, 6]);
    let problem = Problem::cross(1, 4, 6, 7, 3).grouped(2);
    common::check_reference_grads_by_differences(&problem, spec, Some(0.9), 3);
}

/// Heads that do not group, and a softcap that is not finite and positive, are refused.
#[test]
fn invalid_feature_inputs_are_refused() {
    let device = Device::wgpu(Default::default());
    let t = |dims: [usize; 4]| Tensor::<4>::zeros(dims, &device);
    let error = try_flash_attention(
        t([1, 3, 4, 8]),
        t([1, 2, 4, 8]),
        t([1, 2, 4, 8]),
        FlashAttentionOptions::default(),
    )
    .unwrap_err();
    assert_eq!(
        error,
        FlashAttentionError::HeadsMismatch { q: 3, k: 2, v: 2 }
    );
    for cap in [0.0, -2.0, f64::NAN, f64::INFINITY] {
        let options = FlashAttentionOptions::causal().with_softcap(cap);
        let error = try_flash_attention(t([1, 2, 4, 8]), t([1, 1, 4, 8]), t([1, 1, 4, 8]), options)
            .unwrap_err();
        assert!(
            matches!(error, FlashAttentionError::InvalidSoftcap(_)),
            "{error}"
        );
    }
}
