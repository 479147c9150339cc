//! Boolean masks (key padding, full and broadcast) and additive biases (with their gradient),
//! forward and backward, alone and with the causal mask, windows, the softcap and grouped-query
//! attention, against the f64 reference of `common` given the same mask and bias. Rows the mask
//! (or a bias of `-inf`) hides entirely must be exactly 0, gradients included. The checks take
//! the device, dtype and expected path as arguments: `wgpu` runs them on the portable tile in f32
//! (lavapipe in CI) with a fixed tolerance, `cuda` on the tensor-core tile in bf16 with DESIGN.md's
//! 2× rule.

use crate::common;

use burn::tensor::{Bool, DType, Device, Tensor, TensorData};
use burn_flash::{
    AttentionMask, FlashAttentionPlan, TilePath, flash_attention_masked, flash_attention_plan,
};
use common::{
    Inputs, Problem, Scores, Spec, error, masked_rows_scores, random_normal,
    reference_attention_scores, reference_grads_scores, round_to, tensor_from_host, to_host,
    unfused_attention_scores, unfused_grads_scores, widen,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The mask input of a case.
#[derive(Clone, Copy, Debug)]
pub enum MaskInput {
    None,
    /// `[batch, seq_k]`: sequence `b` pads its last `[0, seq_k / 3, seq_k][b % 3]` keys (the
    /// third sees nothing at all).
    KeyPadding,
    /// A random mask (30 % hidden, and query row 1 all hidden when the mask has rows) of these
    /// dims, 1 broadcasting.
    Full([usize; 4]),
    /// `[batch, 1, seq_q, seq_k]` documents: query `i` sees key `j` when `i · seq_k / seq_q`
    /// and `j` fall in the same run of this many keys (runs start at different keys per
    /// batch), so whole blocks are hidden and whole blocks visible.
    Documents(usize),
}

/// The bias input of a case: standard normal values times 2 of these dims (1 broadcasting),
/// with `neg_inf` 20 % of them and query row 2 set to `-inf`, and its gradient checked when
/// `grad`.
#[derive(Clone, Copy, Debug)]
pub struct BiasInput {
    pub dims: [usize; 4],
    pub neg_inf: bool,
    pub grad: bool,
}

/// One checked call.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub problem: Problem,
    pub spec: Spec,
    pub mask: MaskInput,
    pub bias: Option<BiasInput>,
    pub deterministic: bool,
    /// Dropout's probability and seed.
    pub dropout: Option<(f64, u64)>,
    /// ALiBi's biases computed in the kernels.
    pub alibi: bool,
    /// The mask and bias passed expanded to the full scores' dims (stride-0 views of their own
    /// dims, as `Tensor::expand` makes them), not in their own dims.
    pub expanded: bool,
}

impl Case {
    pub fn new(problem: Problem, spec: Spec, mask: MaskInput, bias: Option<BiasInput>) -> Self {
        Self {
            problem,
            spec,
            mask,
            bias,
            deterministic: true,
            dropout: None,
            alibi: false,
            expanded: false,
        }
    }

    /// This case with its mask and bias expanded to the full scores' dims.
    pub fn expanded(self) -> Self {
        Self {
            expanded: true,
            ..self
        }
    }

    /// This case with ALiBi's biases.
    pub fn with_alibi(self) -> Self {
        Self {
            alibi: true,
            ..self
        }
    }

    /// This case with dropout of `prob` seeded by `seed`.
    pub fn with_dropout(self, prob: f64, seed: u64) -> Self {
        Self {
            dropout: Some((prob, seed)),
            ..self
        }
    }
}

/// Dims of the full score matrix.
fn full_dims(p: &Problem) -> [usize; 4] {
    [p.batch, p.heads, p.seq_q, p.seq_k]
}

/// Index in a row-major tensor of `dims` (1 broadcasting) of the full-scores element `at`.
fn broadcast_index(dims: [usize; 4], at: [usize; 4]) -> usize {
    (0..4).fold(0, |index, d| {
        index * dims[d] + if dims[d] == 1 { 0 } else { at[d] }
    })
}

/// Every element index of the full scores, in row-major order.
fn full_positions(p: &Problem) -> impl Iterator<Item = [usize; 4]> + use<> {
    let [b, h, sq, sk] = full_dims(p);
    (0..b * h * sq * sk).map(move |n| [n / (h * sq * sk), n / (sq * sk) % h, n / sk % sq, n % sk])
}

/// `values` of `dims` broadcast to the full scores.
fn expand<T: Copy>(p: &Problem, dims: [usize; 4], values: &[T]) -> Vec<T> {
    full_positions(p)
        .map(|at| values[broadcast_index(dims, at)])
        .collect()
}

/// A full-scores gradient summed down to `dims` (its broadcast dims).
fn reduce(p: &Problem, dims: [usize; 4], full: &[f64]) -> Vec<f64> {
    let mut out = vec![0.0; dims.iter().product()];
    for (at, value) in full_positions(p).zip(full) {
        out[broadcast_index(dims, at)] += value;
    }
    out
}

/// The host mask (in its own dims) and the device mask of a case.
fn mask_values(case: &Case, seed: u64) -> Option<([usize; 4], Vec<bool>)> {
    let p = &case.problem;
    let mut rng = StdRng::seed_from_u64(seed ^ 0x3A5C);
    match case.mask {
        MaskInput::None => None,
        MaskInput::KeyPadding => {
            let dims = [p.batch, 1, 1, p.seq_k];
            let values = (0..p.batch * p.seq_k)
                .map(|n| {
                    let pads = [0, p.seq_k / 3, p.seq_k][(n / p.seq_k) % 3];
                    n % p.seq_k >= p.seq_k - pads
                })
                .collect();
            Some((dims, values))
        }
        MaskInput::Documents(run) => {
            let dims = [p.batch, 1, p.seq_q, p.seq_k];
            let values = (0..p.batch * p.seq_q * p.seq_k)
                .map(|n| {
                    let (batch, i, j) =
                        (n / (p.seq_q * p.seq_k), n / p.seq_k % p.seq_q, n % p.seq_k);
                    let shift = batch * run / 3;
                    (i * p.seq_k / p.seq_q + shift) / run != (j + shift) / run
                })
                .collect();
            Some((dims, values))
        }
        MaskInput::Full(dims) => {
            let len = dims.iter().product();
            let values = (0..len)
                .map(|n| rng.random::<f64>() < 0.3 || (dims[2] > 1 && n / dims[3] % dims[2] == 1))
                .collect();
            Some((dims, values))
        }
    }
}

/// The host bias of a case in its own dims, rounded to `dtype`.
fn bias_values(case: &Case, dtype: DType, seed: u64) -> Option<Vec<f32>> {
    let bias = case.bias?;
    let len = bias.dims.iter().product();
    let mut rng = StdRng::seed_from_u64(seed ^ 0xB1A5);
    Some(
        random_normal(len, seed ^ 0xB1A, DType::F32)
            .into_iter()
            .enumerate()
            .map(|(n, x)| {
                let hidden = bias.neg_inf
                    && (rng.random::<f64>() < 0.2
                        || (bias.dims[2] > 2 && n / bias.dims[3] % bias.dims[2] == 2));
                if hidden {
                    f32::NEG_INFINITY
                } else {
                    round_to(2.0 * x, dtype)
                }
            })
            .collect(),
    )
}

/// One result of a case: `(name, got, reference, unfused baseline, row length)`.
pub type Compared = (&'static str, Vec<f64>, Vec<f64>, Option<Vec<f64>>, usize);

/// What one case computed and what it should have: the output, dq, dk, dv and (when asked) the
/// bias gradient, and what already failed (the plan, rows that must be 0).
pub struct Outcome {
    pub label: String,
    pub plan: FlashAttentionPlan,
    pub results: Vec<Compared>,
    pub failures: Vec<String>,
}

/// Run `case` on `device` (an autodiff device) in `dtype` and compare with the reference (and,
/// when `unfused`, compute the unfused baseline in the dtype for the 2× rule). `tile`: the path
/// the call must take (`None`: the fallback).
pub fn run(
    device: &Device,
    case: &Case,
    dtype: DType,
    seed: u64,
    tile: Option<TilePath>,
    unfused: bool,
) -> Outcome {
    burn_flash::testing::poison_outputs(true);
    let p = case.problem;
    let label = format!(
        "{dtype:?} {p} {} mask {:?} bias {:?} expanded {} alibi {} dropout {:?} deterministic {} \
         seed {seed}",
        case.spec,
        case.mask,
        case.bias,
        case.expanded,
        case.alibi,
        case.dropout,
        case.deterministic
    );
    let inputs = Inputs::random(p, dtype, seed);
    let upstream = random_normal(p.out_dims().iter().product(), seed ^ 0xA5, dtype);
    let [q, k, v] = inputs.to_device(device).map(|t| t.require_grad());
    let mut options = case
        .spec
        .options(None)
        .with_deterministic(case.deterministic);
    if let Some((prob, seed)) = case.dropout {
        options = options.with_dropout(prob, seed);
    }
    options = options.with_alibi(case.alibi);
    let plan = flash_attention_plan(&q, &k, &v, options).unwrap();
    let mut failures = Vec::new();
    // `flash_attention_plan` sees q, k and v only: on SM90, from 1024 keys, that is the Hopper
    // forward, which takes the mask and bias where `warpgroup_blocks` allows them and leaves
    // them to the tensor-core tile otherwise (the tests count its launches).
    let expected = match tile {
        Some(TilePath::TensorCore) if plan == FlashAttentionPlan::FusedWarpgroup => true,
        Some(tile) => common::plan_is(&plan, &FlashAttentionPlan::Fused(tile)),
        None => matches!(plan, FlashAttentionPlan::Fallback(_)),
    };
    if !expected {
        failures.push(format!("{label}: plan {plan}, expected {tile:?}"));
    }

    let mask = mask_values(case, seed);
    let bias = bias_values(case, dtype, seed);
    let device_mask = mask.as_ref().map(|(dims, values)| {
        let full = Tensor::<4, Bool>::from_data(TensorData::new(values.clone(), *dims), device);
        match case.mask {
            MaskInput::KeyPadding => AttentionMask::KeyPadding(full.reshape([p.batch, p.seq_k])),
            _ if case.expanded => AttentionMask::Full(full.expand(full_dims(&p))),
            _ => AttentionMask::Full(full),
        }
    });
    let device_bias = case.bias.zip(bias.as_ref()).map(|(input, values)| {
        let tensor = tensor_from_host(values, input.dims, dtype, device);
        if input.grad {
            tensor.require_grad()
        } else {
            tensor
        }
    });
    // The gradient is the bias leaf's; the call sees the expanded view.
    let call_bias = device_bias.clone().map(|bias| match case.expanded {
        true => bias.expand(full_dims(&p)),
        false => bias,
    });

    let out = flash_attention_masked(
        q.clone(),
        k.clone(),
        v.clone(),
        device_mask,
        call_bias,
        options,
    );
    let grad_out = tensor_from_host(&upstream, p.out_dims(), dtype, device);
    let got_out = to_host(out.clone());
    let grads = (out * grad_out).sum().backward();

    let extra = Scores {
        hidden: mask.map(|(dims, values)| expand(&p, dims, &values)),
        bias: case
            .bias
            .zip(bias.as_ref())
            .map(|(input, values)| expand(&p, input.dims, &widen(values))),
        keep: None,
    };
    // ALiBi adds to the bias input, if any.
    let extra = if case.alibi {
        let alibi = common::alibi_scores(&p, case.spec.top_left);
        Scores {
            bias: Some(match extra.bias {
                Some(bias) => bias.iter().zip(&alibi).map(|(b, a)| b + a).collect(),
                None => alibi,
            }),
            ..extra
        }
    } else {
        extra
    };
    let extra = match case.dropout {
        Some((prob, seed)) => extra.with_dropout(&p, prob, seed),
        None => extra,
    };
    let (q64, k64, v64) = (widen(&inputs.q), widen(&inputs.k), widen(&inputs.v));
    let (reference, _) = reference_attention_scores(&p, &q64, &k64, &v64, case.spec, None, &extra);
    let (rq, rk, rv, rbias) = reference_grads_scores(
        &p,
        &q64,
        &k64,
        &v64,
        &widen(&upstream),
        case.spec,
        None,
        &extra,
    );
    let (uo, uq, uk, uv, ubias) = if unfused {
        let uo = unfused_attention_scores(&inputs, case.spec, None, &extra);
        let (uq, uk, uv, ubias) = unfused_grads_scores(&inputs, &upstream, case.spec, None, &extra);
        (Some(uo), Some(uq), Some(uk), Some(uv), Some(ubias))
    } else {
        (None, None, None, None, None)
    };

    let mut results = Vec::new();
    let mut add = |name: &'static str, got: Option<Vec<f64>>, reference, unfused, row| match got {
        Some(got) => results.push((name, got, reference, unfused, row)),
        None => failures.push(format!("{label}: no {name}")),
    };
    add("output", Some(got_out), reference, uo, p.value_dim);
    add("dq", q.grad(&grads).map(to_host), rq, uq, p.head_dim);
    add("dk", k.grad(&grads).map(to_host), rk, uk, p.head_dim);
    add("dv", v.grad(&grads).map(to_host), rv, uv, p.value_dim);
    if let Some((input, bias)) = case.bias.zip(device_bias).filter(|(input, _)| input.grad) {
        let dims = input.dims;
        add(
            "dbias",
            bias.grad(&grads).map(to_host),
            reduce(&p, dims, &rbias),
            ubias.map(|full| reduce(&p, dims, &full)),
            dims[3],
        );
    }

    // Rows that see no key are exactly 0, in the output and in dq.
    for r in masked_rows_scores(&p, case.spec, &extra) {
        for (name, got, _, _, row) in &results {
            if matches!(*name, "output" | "dq")
                && got[r * row..(r + 1) * row].iter().any(|&x| x != 0.0)
            {
                failures.push(format!("{label}: {name} row {r} sees no key but is not 0"));
            }
        }
    }
    Outcome {
        label,
        plan,
        results,
        failures,
    }
}

/// The portable tile on an autodiff wgpu device in f32 (lavapipe in CI).
mod wgpu {
    use super::*;
    use burn_flash::{
        FlashAttentionError, flash_attention, try_flash_attention, try_flash_attention_masked,
    };

    /// As in `features_wgpu`: f32 rounding stays near 1e-6 on these sizes, one wrongly admitted
    /// or hidden key, or a bias misplaced by one element, moves a row by ~1e-2. Judged on the
    /// global relative error and on every element against `TOLERANCE · max(1, max |ref|)`.
    const TOLERANCE: f64 = 1e-4;

    fn check_all(cases: &[Case], first_seed: u64, tile: Option<TilePath>) {
        let device = Device::wgpu(Default::default()).autodiff();
        let mut failures = Vec::new();
        for (index, case) in cases.iter().enumerate() {
            let started = std::time::Instant::now();
            let outcome = run(
                &device,
                case,
                DType::F32,
                first_seed + index as u64,
                tile,
                false,
            );
            failures.extend(outcome.failures);
            for (name, got, reference, _, row) in &outcome.results {
                let err = error(got, reference, *row);
                eprintln!(
                    "{}: {}: {name} {err} ({:.1?})",
                    outcome.label,
                    outcome.plan,
                    started.elapsed()
                );
                if !(err.finite()
                    && err.relative <= TOLERANCE
                    && err.max_abs <= TOLERANCE * err.ref_max.max(1.0))
                {
                    failures.push(format!(
                        "{}: {name} {err}, tolerance {TOLERANCE:e}",
                        outcome.label
                    ));
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    fn bias(dims: [usize; 4], grad: bool) -> Option<BiasInput> {
        Some(BiasInput {
            dims,
            neg_inf: false,
            grad,
        })
    }

    fn everything() -> Spec {
        Spec {
            causal: true,
            left: Some(30),
            right: None,
            softcap: Some(4.0),
            top_left: false,
        }
    }

    // Each test is one kernel configuration (which inputs, which band bounds, the softcap; all
    // at head dim 16) over several shapes and broadcasts: on a fresh CI machine lavapipe
    // compiles each configuration's kernels for tens of seconds, shapes are free.

    /// Key padding (one sequence padded entirely), full and broadcast masks, documents, with
    /// GQA; decode (`seq_q = 1`).
    #[test]
    fn boolean_masks() {
        let none = Spec::from(false);
        check_all(
            &[
                Case::new(
                    Problem::cross(3, 2, 37, 50, 16),
                    none,
                    MaskInput::KeyPadding,
                    None,
                ),
                Case::new(
                    Problem::cross(3, 2, 1, 77, 16),
                    none,
                    MaskInput::KeyPadding,
                    None,
                ),
                Case::new(
                    Problem::square(2, 2, 40, 16),
                    none,
                    MaskInput::Full([2, 2, 40, 40]),
                    None,
                ),
                Case::new(
                    Problem::cross(2, 2, 30, 45, 16),
                    Spec::from(true),
                    MaskInput::Documents(12),
                    None,
                ),
                Case::new(
                    Problem::cross(2, 4, 45, 70, 16).grouped(2),
                    none,
                    MaskInput::Full([1, 1, 45, 70]),
                    None,
                ),
                Case::new(
                    Problem::cross(2, 2, 33, 40, 16),
                    none,
                    MaskInput::Full([2, 1, 1, 40]),
                    None,
                ),
                // Expanded views: read as the broadcasts they are (a query dim expanded makes
                // a per-key mask).
                Case::new(
                    Problem::cross(2, 4, 45, 70, 16).grouped(2),
                    none,
                    MaskInput::Full([1, 1, 45, 70]),
                    None,
                )
                .expanded(),
                Case::new(
                    Problem::cross(2, 2, 33, 40, 16),
                    none,
                    MaskInput::Full([2, 1, 1, 40]),
                    None,
                )
                .expanded(),
            ],
            700,
            Some(TilePath::Portable),
        );
    }

    /// Additive biases with their gradient: full, per head (ALiBi's shape), per key, with GQA.
    #[test]
    fn additive_bias() {
        let none = Spec::from(false);
        check_all(
            &[
                Case::new(
                    Problem::square(2, 2, 33, 16),
                    none,
                    MaskInput::None,
                    bias([2, 2, 33, 33], true),
                ),
                Case::new(
                    Problem::cross(2, 2, 40, 60, 16),
                    none,
                    MaskInput::None,
                    bias([1, 2, 40, 60], true),
                ),
                Case::new(
                    Problem::cross(2, 4, 20, 50, 16).grouped(1),
                    none,
                    MaskInput::None,
                    bias([2, 1, 1, 50], true),
                ),
                Case::new(
                    Problem::cross(2, 2, 40, 60, 16),
                    none,
                    MaskInput::None,
                    bias([1, 2, 40, 60], true),
                )
                .expanded(),
            ],
            720,
            Some(TilePath::Portable),
        );
    }

    /// Masks and biases with the causal mask, a window, the softcap and GQA all at once; `-inf`
    /// in the bias hides pairs and whole rows.
    #[test]
    fn bias_and_mask_together() {
        check_all(
            &[
                Case::new(
                    Problem::square(3, 2, 36, 16),
                    everything(),
                    MaskInput::KeyPadding,
                    Some(BiasInput {
                        dims: [3, 2, 36, 36],
                        neg_inf: true,
                        grad: true,
                    }),
                ),
                Case::new(
                    Problem::cross(2, 4, 50, 80, 16).grouped(2),
                    everything(),
                    MaskInput::Full([2, 1, 50, 80]),
                    bias([1, 4, 50, 80], true),
                ),
            ],
            740,
            Some(TilePath::Portable),
        );
    }

    /// Dropout of the probabilities, forward and backward, against the reference given the mask
    /// of the documented generator (`common::dropout_keeps`): alone (with GQA, a seed using both
    /// halves, a probability of 0.9, 8-key blocks), then with a mask, a bias, the causal mask, a
    /// window and the softcap at once.
    #[test]
    fn dropout() {
        let none = Spec::from(false);
        check_all(
            &[
                Case::new(
                    Problem::cross(2, 4, 37, 50, 16).grouped(2),
                    none,
                    MaskInput::None,
                    None,
                )
                .with_dropout(0.3, 11),
                Case::new(Problem::square(1, 2, 64, 16), none, MaskInput::None, None)
                    .with_dropout(0.9, u64::MAX - 5),
                // A value dim above 128 makes 8-key blocks: each register draws its own hash.
                Case::new(
                    Problem::cross(1, 1, 20, 44, 16).with_value_dim(136),
                    none,
                    MaskInput::None,
                    None,
                )
                .with_dropout(0.4, 9),
            ],
            780,
            Some(TilePath::Portable),
        );
        check_all(
            &[Case::new(
                Problem::square(3, 2, 36, 16),
                everything(),
                MaskInput::KeyPadding,
                bias([3, 2, 36, 36], true),
            )
            .with_dropout(0.5, 1 << 40)],
            790,
            Some(TilePath::Portable),
        );
    }

    /// ALiBi's biases computed in the kernels, with the slopes of 6 heads (not a power of two:
    /// the interleaved slopes) and GQA; then with the causal mask, a key-padding mask and a
    /// bias input with its gradient (ALiBi adds none).
    #[test]
    fn alibi() {
        check_all(
            &[
                Case::new(
                    Problem::cross(2, 6, 37, 50, 16).grouped(3),
                    Spec::from(false),
                    MaskInput::None,
                    None,
                )
                .with_alibi(),
                Case::new(
                    Problem::cross(1, 8, 50, 30, 16),
                    Spec::from(false),
                    MaskInput::None,
                    None,
                )
                .with_alibi(),
                // Top-left: the distances are to key `i`, causal or not.
                Case::new(
                    Problem::cross(1, 4, 30, 50, 16),
                    Spec::from(true).top_left(),
                    MaskInput::None,
                    None,
                )
                .with_alibi(),
                Case::new(
                    Problem::cross(1, 3, 45, 20, 16),
                    Spec::from(false).top_left(),
                    MaskInput::None,
                    None,
                )
                .with_alibi(),
            ],
            800,
            Some(TilePath::Portable),
        );
        check_all(
            &[Case::new(
                Problem::square(3, 4, 40, 16),
                Spec::from(true),
                MaskInput::KeyPadding,
                bias([1, 4, 40, 40], true),
            )
            .with_alibi()],
            810,
            Some(TilePath::Portable),
        );
    }

    /// The same seed draws the same mask, another seed another one, a probability of 0 is no
    /// dropout at all (bit for bit); a probability outside `[0, 1)` is refused, and so is
    /// dropout on inputs only the fallback can run.
    #[test]
    fn dropout_seeds_and_refusals() {
        use burn_flash::FlashAttentionOptions;
        let device = Device::wgpu(Default::default());
        let p = Problem::square(1, 2, 40, 16);
        let inputs = Inputs::random(p, DType::F32, 5);
        let [q, k, v] = inputs.to_device(&device);
        let run = |options: FlashAttentionOptions| {
            to_host(flash_attention(q.clone(), k.clone(), v.clone(), options))
        };
        let plain = run(FlashAttentionOptions::new());
        let first = run(FlashAttentionOptions::new().with_dropout(0.5, 3));
        assert_eq!(
            first,
            run(FlashAttentionOptions::new().with_dropout(0.5, 3))
        );
        assert_ne!(
            first,
            run(FlashAttentionOptions::new().with_dropout(0.5, 4))
        );
        assert_ne!(first, plain);
        assert_eq!(
            plain,
            run(FlashAttentionOptions::new().with_dropout(0.0, 3))
        );
        for prob in [-0.1, 1.0, f64::NAN] {
            let options = FlashAttentionOptions::new().with_dropout(prob, 0);
            let error = try_flash_attention(q.clone(), k.clone(), v.clone(), options).unwrap_err();
            assert!(
                matches!(error, FlashAttentionError::InvalidDropout(_)),
                "{prob}: {error}"
            );
        }
        let wide = Tensor::<4>::zeros([1, 1, 4, 288], &device);
        let options = FlashAttentionOptions::new().with_dropout(0.1, 0);
        let error =
            try_flash_attention(wide.clone(), wide.clone(), wide.clone(), options).unwrap_err();
        assert!(
            matches!(error, FlashAttentionError::DropoutUnsupported(_)),
            "{error}"
        );
        let options = FlashAttentionOptions::new().with_dropout(0.0, 0);
        assert!(try_flash_attention(wide.clone(), wide.clone(), wide, options).is_ok());
    }

    /// A head dim the fused kernels do not take falls back to Burn's unfused attention with the
    /// same mask and bias semantics, gradients included (0, not NaN, for the bias in rows that
    /// see no key).
    #[test]
    fn masks_and_bias_on_the_fallback() {
        check_all(
            // `features_on_the_fallback`'s shape: lavapipe reuses its matmul kernels.
            &[
                Case::new(
                    Problem::cross(1, 4, 19, 23, 288).grouped(2),
                    Spec::from(true),
                    MaskInput::Full([1, 1, 19, 23]),
                    Some(BiasInput {
                        dims: [1, 4, 19, 23],
                        neg_inf: true,
                        grad: true,
                    }),
                ),
                Case::new(
                    Problem::cross(1, 4, 19, 23, 288).grouped(2),
                    Spec::from(false),
                    MaskInput::None,
                    Some(BiasInput {
                        dims: [1, 4, 19, 23],
                        neg_inf: false,
                        grad: true,
                    }),
                )
                .with_alibi(),
            ],
            760,
            None,
        );
    }

    #[test]
    fn invalid_masks_and_biases_are_refused() {
        let device = Device::wgpu(Default::default());
        let t = |dims: [usize; 4]| Tensor::<4>::zeros(dims, &device);
        let run = |mask: Option<AttentionMask>, bias: Option<Tensor<4>>| {
            let x = t([2, 3, 4, 8]);
            let kv = t([2, 3, 5, 8]);
            let options = burn_flash::FlashAttentionOptions::new();
            try_flash_attention_masked(x, kv.clone(), kv, mask, bias, options).unwrap_err()
        };
        let padding =
            |dims: [usize; 2]| AttentionMask::KeyPadding(Tensor::<2, Bool>::empty(dims, &device));
        let full = |dims: [usize; 4]| AttentionMask::Full(Tensor::<4, Bool>::empty(dims, &device));
        for (mask, got) in [
            (padding([2, 4]), vec![2, 4]),
            (padding([3, 5]), vec![3, 5]),
            (full([2, 3, 5, 5]), vec![2, 3, 5, 5]),
            (full([2, 2, 4, 5]), vec![2, 2, 4, 5]),
            (full([2, 3, 4, 1]), vec![2, 3, 4, 1]),
        ] {
            match run(Some(mask), None) {
                FlashAttentionError::MaskShape { got: shape, .. } => assert_eq!(shape, got),
                other => panic!("expected a mask shape error, got {other}"),
            }
        }
        for dims in [[3, 3, 4, 5], [2, 3, 4, 4], [2, 3, 2, 5]] {
            let error = run(None, Some(t(dims)));
            assert_eq!(
                error,
                FlashAttentionError::BiasShape {
                    expected: "[2|1, 3|1, 4|1, 5]".into(),
                    got: dims.to_vec(),
                },
                "{error}"
            );
        }
        // Broadcast shapes are accepted.
        let x = t([2, 3, 4, 8]);
        let out = try_flash_attention_masked(
            x.clone(),
            x.clone(),
            x,
            Some(full([1, 3, 1, 4])),
            Some(t([2, 1, 4, 4])),
            burn_flash::FlashAttentionOptions::new(),
        );
        assert!(out.is_ok());
    }
}

/// The library's ALiBi slopes (which the kernels compute the same way) are the paper's, for every
/// head count up to 64.
#[test]
fn alibi_slopes_match_the_paper() {
    for heads in 1..=64 {
        let (got, want) = (
            burn_flash::alibi_slopes(heads),
            common::paper_alibi_slopes(heads),
        );
        assert_eq!(got.len(), heads);
        for (h, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-12 * w,
                "{heads} heads, head {h}: {g} against {w}"
            );
        }
    }
}

/// The documented dropout generator (which the kernels match exactly, see `wgpu::dropout`)
/// behaves like independent coins: per head, the kept fraction is within 5σ of the threshold's
/// probability, and keys that share one hash (`j`, `j + 1` and `j`, `j + 8`) and neighbouring
/// queries are uncorrelated within 5σ; two heads of one seed, and two seeds, draw different
/// masks.
#[test]
fn dropout_generator_statistics() {
    let n = 256;
    let phi = |pairs: &[(bool, bool)]| {
        let count = pairs.len() as f64;
        let mean = |f: &dyn Fn(&(bool, bool)) -> bool| {
            pairs.iter().filter(|pair| f(pair)).count() as f64 / count
        };
        let (a, b, both) = (mean(&|p| p.0), mean(&|p| p.1), mean(&|p| p.0 && p.1));
        (both - a * b) / (a * (1.0 - a) * b * (1.0 - b)).sqrt()
    };
    for (prob, seed) in [(0.1, 0u64), (0.5, 12345), (0.8, u64::MAX)] {
        let keep_prob = common::dropout_threshold(prob) as f64 / 256.0;
        let mut masks = Vec::new();
        for bh in 0..3 {
            let mask: Vec<bool> = (0..n * n)
                .map(|at| common::dropout_keeps(seed, prob, bh, at / n, at % n, n))
                .collect();
            let kept = mask.iter().filter(|&&k| k).count() as f64 / (n * n) as f64;
            let sigma = (keep_prob * (1.0 - keep_prob) / (n * n) as f64).sqrt();
            assert!(
                (kept - keep_prob).abs() <= 5.0 * sigma,
                "p {prob} seed {seed} head {bh}: kept {kept}, expected {keep_prob}"
            );
            let keys: Vec<(bool, bool)> = (0..n * n / 2)
                .map(|pair| (mask[2 * pair], mask[2 * pair + 1]))
                .collect();
            let eighth_keys: Vec<(bool, bool)> = (0..n * n)
                .filter(|at| at % 16 < 8)
                .map(|at| (mask[at], mask[at + 8]))
                .collect();
            let queries: Vec<(bool, bool)> = (0..n * (n - 1))
                .map(|at| (mask[at], mask[at + n]))
                .collect();
            for (what, pairs) in [
                ("keys", keys),
                ("keys 8 apart", eighth_keys),
                ("queries", queries),
            ] {
                let r = phi(&pairs);
                let bound = 5.0 / (pairs.len() as f64).sqrt();
                assert!(
                    r.abs() <= bound,
                    "p {prob} seed {seed} head {bh}: neighbouring {what} correlate ({r})"
                );
            }
            masks.push(mask);
        }
        assert!(masks[0] != masks[1] && masks[1] != masks[2]);
        let other: Vec<bool> = (0..n * n)
            .map(|at| common::dropout_keeps(seed ^ 1, prob, 0, at / n, at % n, n))
            .collect();
        assert!(other != masks[0]);
    }
}

/// Inputs on two devices: `q`, `k`, `v` on the default wgpu device and one of them, or the
/// mask, or the bias, on wgpu's CPU device (lavapipe is both in CI, but Burn keeps them apart).
/// Skipped, with a printed reason, where the runtime has no CPU adapter.
#[test]
fn inputs_on_another_device_are_refused() {
    use burn::tensor::DeviceKind;
    use burn_flash::{FlashAttentionError, FlashAttentionOptions, try_flash_attention_masked};
    use std::io::Write;

    let here = Device::wgpu(DeviceKind::DefaultDevice);
    let there = Device::wgpu(DeviceKind::Cpu);
    let probe = std::panic::catch_unwind(|| Tensor::<1>::zeros([1], &there).into_data());
    if probe.is_err() {
        let _ = writeln!(
            std::io::stderr(),
            "inputs_on_another_device_are_refused: skipping: no wgpu CPU adapter"
        );
        return;
    }
    let t = |device: &Device| Tensor::<4>::zeros([1, 2, 4, 8], device);
    let mask = |device: &Device| {
        Some(AttentionMask::Full(Tensor::<4, Bool>::empty(
            [1, 2, 4, 4],
            device,
        )))
    };
    let bias = |device: &Device| Some(Tensor::<4>::zeros([1, 2, 4, 4], device));
    let options = FlashAttentionOptions::new();
    let error =
        try_flash_attention_masked(t(&here), t(&there), t(&here), None, None, options).unwrap_err();
    assert!(
        matches!(error, FlashAttentionError::DeviceMismatch { .. }),
        "{error}"
    );
    for (input, mask, bias) in [
        ("mask", mask(&there), bias(&here)),
        ("bias", mask(&here), bias(&there)),
    ] {
        let error = try_flash_attention_masked(t(&here), t(&here), t(&here), mask, bias, options)
            .unwrap_err();
        match error {
            FlashAttentionError::InputDevice { input: got, .. } => assert_eq!(got, input),
            other => panic!("expected a device error for the {input}, got {other}"),
        }
    }
}

/// The tensor-core tile on an autodiff CUDA device in bf16 (Burn 0.21: `Autodiff<Cuda<bf16>>`),
/// with DESIGN.md's 2× rule.
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use burn_flash::{FlashAttentionError, FlashAttentionOptions, try_flash_attention_masked};
    use common::cuda::cuda_device;

    fn check_all(test: &str, cases: &[Case], first_seed: u64) {
        let Some(device) = cuda_device(test) else {
            return;
        };
        let device = device.autodiff();
        let mut failures = Vec::new();
        for (index, case) in cases.iter().enumerate() {
            let seed = first_seed + index as u64;
            let outcome = run(
                &device,
                case,
                DType::BF16,
                seed,
                Some(TilePath::TensorCore),
                true,
            );
            failures.extend(outcome.failures);
            for (name, got, reference, unfused, row) in &outcome.results {
                let unfused = unfused.as_ref().expect("unfused baseline");
                failures.extend(crate::reliability::twice_unfused(
                    &outcome.label,
                    name,
                    got,
                    unfused,
                    reference,
                    *row,
                    DType::BF16,
                    0.0,
                ));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    fn bias(dims: [usize; 4]) -> Option<BiasInput> {
        Some(BiasInput {
            dims,
            neg_inf: false,
            grad: true,
        })
    }

    /// Dropout on the tensor cores at several head dims, with GQA, causal, the atomic dQ, a
    /// padding mask and a bias with its gradient; the unfused baseline drops the same pairs.
    #[test]
    fn dropout_cuda() {
        // The atomic case must run the atomic dQ, not the faster launch for its 300 keys.
        let _atomic = burn_flash::testing::force_atomic_dq();
        let mut atomic = Case::new(
            Problem::square(1, 2, 300, 128),
            Spec::from(false),
            MaskInput::None,
            None,
        )
        .with_dropout(0.3, 77);
        atomic.deterministic = false;
        check_all(
            "dropout_cuda",
            &[
                Case::new(
                    Problem::cross(2, 4, 130, 200, 64).grouped(2),
                    Spec::from(true),
                    MaskInput::None,
                    None,
                )
                .with_dropout(0.1, 5),
                atomic,
                Case::new(
                    Problem::cross(1, 2, 150, 77, 256),
                    Spec::from(false),
                    MaskInput::None,
                    None,
                )
                .with_dropout(0.2, u64::MAX),
                Case::new(
                    Problem::square(2, 2, 140, 96),
                    Spec::from(true),
                    MaskInput::KeyPadding,
                    bias([1, 2, 140, 140]),
                )
                .with_dropout(0.5, 1 << 33),
            ],
            850,
        );
    }

    /// ALiBi on the tensor cores: 12 heads causal at d 128, 6 heads (interleaved slopes) over 2
    /// key/value heads with a bias gradient at d 64, not causal, more keys than queries; a
    /// document mask (whole blocks skipped, the walk narrowed to the visible ones); a window
    /// over fewer keys than queries (early rows' diagonals left of key 0).
    #[test]
    fn alibi_cuda() {
        check_all(
            "alibi_cuda",
            &[
                Case::new(
                    Problem::square(1, 12, 200, 128),
                    Spec::from(true),
                    MaskInput::None,
                    None,
                )
                .with_alibi(),
                Case::new(
                    Problem::cross(2, 6, 130, 260, 64).grouped(2),
                    Spec::from(false),
                    MaskInput::None,
                    bias([1, 6, 130, 260]),
                )
                .with_alibi(),
                Case::new(
                    Problem::square(2, 4, 520, 64),
                    Spec::from(false),
                    MaskInput::Documents(150),
                    None,
                )
                .with_alibi(),
                Case::new(
                    Problem::cross(1, 8, 333, 200, 128),
                    Spec {
                        left: Some(90),
                        right: Some(70),
                        ..Spec::default()
                    },
                    MaskInput::None,
                    None,
                )
                .with_alibi(),
            ],
            870,
        );
    }

    /// Masks at tensor-core head dims, across several 128×64 forward and 64×64 backward blocks.
    #[test]
    fn boolean_masks_cuda() {
        check_all(
            "boolean_masks_cuda",
            &[
                // 208 keys: staged (one row of keys per block); 300 keys: read in place.
                Case::new(
                    Problem::cross(3, 2, 130, 208, 64),
                    Spec::from(false),
                    MaskInput::KeyPadding,
                    None,
                ),
                Case::new(
                    Problem::cross(3, 2, 1, 300, 128),
                    Spec::from(false),
                    MaskInput::KeyPadding,
                    None,
                ),
                Case::new(
                    Problem::square(2, 2, 150, 128),
                    Spec::from(true),
                    MaskInput::Full([2, 2, 150, 150]),
                    None,
                ),
                // The tensor-core forward packs per-pair masks into bits: the last KV block and
                // query block cross the sequences' ends, an odd key count reads the mask an
                // element at a time.
                // Documents: planes skip the blocks the mask hides wholly, and select nothing
                // in the blocks it hides nowhere.
                Case::new(
                    Problem::square(3, 2, 400, 64),
                    Spec::from(false),
                    MaskInput::Documents(96),
                    None,
                ),
                // Expanded over heads: packed once per batch.
                Case::new(
                    Problem::square(3, 2, 400, 64),
                    Spec::from(true),
                    MaskInput::Documents(96),
                    None,
                )
                .expanded(),
                Case::new(
                    Problem::cross(2, 2, 300, 520, 128),
                    Spec::from(true),
                    MaskInput::Documents(150),
                    None,
                ),
                Case::new(
                    Problem::cross(2, 3, 70, 333, 64),
                    Spec::from(true),
                    MaskInput::Full([2, 1, 70, 333]),
                    None,
                ),
                Case::new(
                    Problem::cross(2, 2, 150, 208, 128),
                    Spec::from(true),
                    MaskInput::Full([2, 2, 150, 208]),
                    None,
                ),
                Case::new(
                    Problem::cross(1, 4, 140, 256, 64).grouped(2),
                    Spec {
                        left: Some(90),
                        right: Some(20),
                        ..Spec::default()
                    },
                    MaskInput::Full([1, 1, 140, 256]),
                    None,
                ),
            ],
            800,
        );
    }

    /// Masks and biases on the Hopper forward through the API, as the plan takes them by
    /// default, over a thousand keys and more so that it takes the Hopper forward, with their
    /// gradients by the backward kernels from its output and log-sum-exp:
    /// a random mask and a bias per head at head dim 128, documents under a causal mask at 64,
    /// a bias for every batch with a causal mask at 128 (its cubes batch-inner), and key
    /// padding (none, a third, every key) at 128. On a GPU without warpgroup products the tile
    /// runs them.
    #[test]
    fn warpgroup_inputs_cuda() {
        let Some(device) = cuda_device("warpgroup_inputs_cuda") else {
            return;
        };
        let before = burn_flash::testing::warpgroup_forward_launches();
        check_all(
            "warpgroup_inputs_cuda",
            &[
                Case::new(
                    Problem::square(1, 2, 1104, 128),
                    Spec::from(false),
                    MaskInput::Full([1, 1, 1104, 1104]),
                    bias([1, 2, 1104, 1104]),
                ),
                Case::new(
                    Problem::square(1, 2, 2112, 64),
                    Spec::from(true),
                    MaskInput::Documents(700),
                    None,
                ),
                Case::new(
                    Problem::square(2, 2, 2112, 128),
                    Spec::from(true),
                    MaskInput::None,
                    bias([1, 2, 2112, 2112]),
                ),
                Case::new(
                    Problem::square(3, 2, 1104, 128),
                    Spec::from(false),
                    MaskInput::KeyPadding,
                    None,
                ),
            ],
            7700,
        );
        let hopper = burn_flash::testing::warpgroup_forward_launches() - before;
        eprintln!("warpgroup_inputs_cuda: {hopper} forwards on warpgroup products");
        if common::cuda::has_wgmma(&device) {
            assert!(
                hopper >= 4,
                "each case's forward on warpgroup products, not {hopper}"
            );
        }
    }

    /// Dropout on the Hopper forward (SM90, from 1024 keys walked; at head dim 64 over more
    /// than 2048 keys), the gradients by the backward kernels regenerating the same keep
    /// decisions: at head dim 128 alone and under a causal mask beside a bias per head, at 64
    /// with GQA, a random mask and queries and keys ending inside a block. On a GPU without
    /// warpgroup products the tile runs them.
    #[test]
    fn warpgroup_dropout_cuda() {
        let Some(device) = cuda_device("warpgroup_dropout_cuda") else {
            return;
        };
        let before = burn_flash::testing::warpgroup_forward_launches();
        check_all(
            "warpgroup_dropout_cuda",
            &[
                Case::new(
                    Problem::square(1, 2, 1104, 128),
                    Spec::from(false),
                    MaskInput::None,
                    None,
                )
                .with_dropout(0.2, 11),
                Case::new(
                    Problem::cross(2, 4, 400, 2200, 64).grouped(2),
                    Spec::from(false),
                    MaskInput::Full([2, 1, 400, 2200]),
                    None,
                )
                .with_dropout(0.5, 1 << 33),
                Case::new(
                    Problem::square(1, 2, 2112, 128),
                    Spec::from(true),
                    MaskInput::None,
                    bias([1, 2, 2112, 2112]),
                )
                .with_dropout(0.1, u64::MAX),
            ],
            7800,
        );
        let hopper = burn_flash::testing::warpgroup_forward_launches() - before;
        eprintln!("warpgroup_dropout_cuda: {hopper} forwards on warpgroup products");
        if common::cuda::has_wgmma(&device) {
            assert!(
                hopper >= 3,
                "each case's forward on warpgroup products, not {hopper}"
            );
        }
    }

    /// Biases with gradients (full, per head, per key, with `-inf`), with the softcap, GQA, the
    /// atomic-dQ option (a bias gradient keeps the dQ launch) and a mask.
    #[test]
    fn additive_bias_cuda() {
        let capped = Spec {
            causal: true,
            softcap: Some(5.0),
            ..Spec::default()
        };
        let mut atomic = Case::new(
            Problem::cross(2, 4, 130, 150, 128).grouped(2),
            capped,
            MaskInput::None,
            bias([1, 4, 130, 150]),
        );
        atomic.deterministic = false;
        check_all(
            "additive_bias_cuda",
            &[
                Case::new(
                    Problem::square(2, 2, 140, 64),
                    Spec::from(false),
                    MaskInput::None,
                    bias([2, 2, 140, 140]),
                ),
                // Key counts that are multiples of 8: the forward stages these biases in shared
                // memory; at d 256 only the mask fits beside the K/V stages.
                Case::new(
                    Problem::cross(2, 2, 140, 144, 64),
                    Spec::from(false),
                    MaskInput::None,
                    bias([2, 2, 140, 144]),
                ),
                Case::new(
                    Problem::square(2, 2, 192, 128),
                    Spec::from(true),
                    MaskInput::KeyPadding,
                    Some(BiasInput {
                        dims: [2, 2, 192, 192],
                        neg_inf: true,
                        grad: true,
                    }),
                ),
                Case::new(
                    Problem::square(1, 2, 160, 256),
                    Spec::from(false),
                    MaskInput::Full([1, 2, 160, 160]),
                    bias([1, 1, 160, 160]),
                ),
                // Expanded views, staged as the broadcasts they are.
                Case::new(
                    Problem::cross(2, 2, 140, 144, 64),
                    Spec::from(true),
                    MaskInput::Full([2, 1, 140, 144]),
                    bias([1, 2, 140, 144]),
                )
                .expanded(),
                atomic,
                Case::new(
                    Problem::cross(2, 2, 70, 200, 64),
                    Spec::from(false),
                    MaskInput::None,
                    bias([2, 1, 1, 200]),
                ),
                Case::new(
                    Problem::square(3, 2, 100, 128),
                    Spec::from(true),
                    MaskInput::KeyPadding,
                    Some(BiasInput {
                        dims: [3, 2, 100, 100],
                        neg_inf: true,
                        grad: true,
                    }),
                ),
                // `-inf` in a staged bf16 bias at head dim 64, where the tensor cores add it
                // with the factor in one part.
                Case::new(
                    Problem::square(2, 2, 136, 64),
                    Spec::from(false),
                    MaskInput::None,
                    Some(BiasInput {
                        dims: [2, 2, 136, 136],
                        neg_inf: true,
                        grad: false,
                    }),
                ),
            ],
            820,
        );
    }

    #[test]
    fn bias_dtype_must_match_cuda() {
        let Some(device) = cuda_device("bias_dtype_must_match_cuda") else {
            return;
        };
        let x = tensor_from_host(&[0.0; 1024], [1, 2, 8, 64], DType::BF16, &device);
        let bias = tensor_from_host(&[0.0; 128], [1, 2, 8, 8], DType::F32, &device);
        let error = try_flash_attention_masked(
            x.clone(),
            x.clone(),
            x,
            None,
            Some(bias),
            FlashAttentionOptions::new(),
        )
        .unwrap_err();
        assert_eq!(
            error,
            FlashAttentionError::BiasDType {
                expected: DType::BF16,
                got: DType::F32
            }
        );
    }
}
