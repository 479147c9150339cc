//! `try_flash_attention_varlen`: sequences of different lengths packed along the rows of
//! `[total, heads, dim]` tensors, against an f64 reference that attends each sequence alone
//! (its own inputs, its diagonal on its own lengths), on every path the call takes: the fused
//! forward reading the packed rows in place and its fused backward (gradients checked too), and
//! the padded batch through Burn's unfused attention where no tile runs the head dim. On
//! wgpu (f32, the portable tile) and, with feature `cuda`, on the tensor-core tile in bf16.
//! Outputs are poisoned with NaN before the kernels run.

use crate::common;

use burn::tensor::{DType, Device, Distribution, Tensor};
use burn_flash::{FlashAttentionError, PackedSequences, try_flash_attention_varlen};
use common::{
    Error, Inputs, Problem, Scores, Spec, error, reference_attention_scores,
    reference_grads_scores, to_host, widen,
};

/// One packed batch: each sequence's (queries, keys), and the heads and dims they share.
#[derive(Clone, Debug)]
struct Batch {
    lengths: Vec<(usize, usize)>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    value_dim: usize,
}

impl Batch {
    fn new(lengths: &[(usize, usize)], heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        Self {
            lengths: lengths.to_vec(),
            heads,
            kv_heads,
            head_dim,
            value_dim: head_dim,
        }
    }

    /// Self-attention: queries and keys of the same lengths.
    fn same(lengths: &[usize], heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        let pairs: Vec<_> = lengths.iter().map(|&n| (n, n)).collect();
        Self::new(&pairs, heads, kv_heads, head_dim)
    }

    fn value_dim(self, value_dim: usize) -> Self {
        Self { value_dim, ..self }
    }

    /// Dropout of `prob` seeded by `seed` over sequence `s` as the packed kernels draw it:
    /// the sequence is batch entry `s`, its queries and keys counted from its first rows, over
    /// a row of the packing's total keys (`docs/features.md`, "Variable-length batches").
    fn dropout(&self, s: usize, (prob, seed): (f64, u64)) -> Scores {
        let total_k = self.lengths.iter().map(|l| l.1).sum();
        Scores::default().with_dropout_at(&self.problem(s), prob, seed, s * self.heads, total_k)
    }

    /// Sequence `s` as a one-sequence problem of its own.
    fn problem(&self, s: usize) -> Problem {
        let (lq, lk) = self.lengths[s];
        Problem::cross(1, self.heads, lq, lk, self.head_dim)
            .grouped(self.kv_heads)
            .with_value_dim(self.value_dim)
    }

    fn packing(&self, device: &Device) -> PackedSequences {
        let (queries, keys): (Vec<usize>, Vec<usize>) = self.lengths.iter().copied().unzip();
        PackedSequences::with_keys(&queries, &keys, device).expect("as many keys as queries")
    }
}

/// `[1, heads, rows, dim]` host values of each sequence, packed into `[total, heads, dim]`.
fn pack(parts: &[(&[f64], usize)], heads: usize, dim: usize) -> Vec<f64> {
    let mut packed = Vec::new();
    for &(values, rows) in parts {
        for row in 0..rows {
            for head in 0..heads {
                let at = (head * rows + row) * dim;
                packed.extend_from_slice(&values[at..at + dim]);
            }
        }
    }
    packed
}

/// A `[total, heads, dim]` device tensor of `dtype` holding `values` (representable in it).
fn packed_tensor(values: &[f64], dims: [usize; 3], dtype: DType, device: &Device) -> Tensor<3> {
    let values: Vec<f32> = values.iter().map(|&x| x as f32).collect();
    common::tensor_from_host(&values, [1, dims[0], dims[1], dims[2]], dtype, device).reshape(dims)
}

/// Each sequence's inputs, the packed device tensors and the packed reference output (and, with
/// `grad_out`, the packed reference gradients of `sum(out ∘ grad_out)`).
struct Packed {
    inputs: Vec<Inputs>,
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
}

impl Packed {
    fn draw(batch: &Batch, dtype: DType, seed: u64, device: &Device) -> Self {
        let inputs: Vec<Inputs> = (0..batch.lengths.len())
            .map(|s| Inputs::random(batch.problem(s), dtype, seed * 100 + s as u64))
            .collect();
        let widened: Vec<[Vec<f64>; 3]> = inputs
            .iter()
            .map(|i| [widen(&i.q), widen(&i.k), widen(&i.v)])
            .collect();
        let side = |n: usize, heads: usize, dim: usize, rows: fn(&(usize, usize)) -> usize| {
            let parts: Vec<(&[f64], usize)> = widened
                .iter()
                .zip(&batch.lengths)
                .map(|(w, l)| (&w[n][..], rows(l)))
                .collect();
            let total = batch.lengths.iter().map(rows).sum();
            packed_tensor(
                &pack(&parts, heads, dim),
                [total, heads, dim],
                dtype,
                device,
            )
        };
        let (h, hkv, d, dv) = (batch.heads, batch.kv_heads, batch.head_dim, batch.value_dim);
        Self {
            q: side(0, h, d, |l| l.0),
            k: side(1, hkv, d, |l| l.1),
            v: side(2, hkv, dv, |l| l.1),
            inputs,
        }
    }

    /// The packed reference output `[total_q, heads, value_dim]`, with dropout where given.
    fn reference(&self, batch: &Batch, spec: Spec, dropout: Option<(f64, u64)>) -> Vec<f64> {
        let outs: Vec<Vec<f64>> = self
            .inputs
            .iter()
            .enumerate()
            .map(|(s, i)| {
                let extra = dropout.map_or_else(Scores::default, |d| batch.dropout(s, d));
                let (q, k, v) = (widen(&i.q), widen(&i.k), widen(&i.v));
                reference_attention_scores(&i.problem, &q, &k, &v, spec, None, &extra).0
            })
            .collect();
        let parts: Vec<(&[f64], usize)> = outs
            .iter()
            .zip(&batch.lengths)
            .map(|(o, l)| (&o[..], l.0))
            .collect();
        pack(&parts, batch.heads, batch.value_dim)
    }

    /// The packed reference gradients of q, k and v for the packed output gradient `grad_out`.
    fn reference_grads(
        &self,
        batch: &Batch,
        spec: Spec,
        dropout: Option<(f64, u64)>,
        grad_out: &[f64],
    ) -> [Vec<f64>; 3] {
        let (h, hkv, d, dv) = (batch.heads, batch.kv_heads, batch.head_dim, batch.value_dim);
        let mut row = 0;
        let mut grads = Vec::new();
        for (s, (inputs, &(lq, _))) in self.inputs.iter().zip(&batch.lengths).enumerate() {
            // This sequence's `[total, h, dv]` rows as `[1, h, lq, dv]`.
            let mut g = vec![0.0; h * lq * dv];
            for i in 0..lq {
                for head in 0..h {
                    let from = ((row + i) * h + head) * dv;
                    g[(head * lq + i) * dv..][..dv].copy_from_slice(&grad_out[from..from + dv]);
                }
            }
            row += lq;
            let (q, k, v) = (widen(&inputs.q), widen(&inputs.k), widen(&inputs.v));
            let extra = dropout.map_or_else(Scores::default, |d| batch.dropout(s, d));
            let (dq, dk, dv, _) =
                reference_grads_scores(&inputs.problem, &q, &k, &v, &g, spec, None, &extra);
            grads.push([dq, dk, dv]);
        }
        // Gradient `n` of every sequence, `rows` rows of `heads` heads each, packed.
        let side = |n: usize, rows: fn(&(usize, usize)) -> usize, heads, dim| {
            let parts: Vec<(&[f64], usize)> = grads
                .iter()
                .zip(&batch.lengths)
                .map(|(g, l)| (&g[n][..], rows(l)))
                .collect();
            pack(&parts, heads, dim)
        };
        [
            side(0, |l| l.0, h, d),
            side(1, |l| l.1, hkv, d),
            side(2, |l| l.1, hkv, dv),
        ]
    }
}

/// The padded path's specs: its queries are padded after a sequence's rows top-left, before
/// them bottom-right.
fn padded_specs() -> [Spec; 2] {
    [Spec::from(true), Spec::from(true).top_left()]
}

/// Causal and not, a window, top-left.
fn specs() -> Vec<Spec> {
    vec![
        Spec::from(true),
        Spec::from(false),
        Spec {
            causal: true,
            left: Some(20),
            ..Spec::default()
        },
        Spec::from(true).top_left(),
    ]
}

/// The forward of each of `specs` on fresh inputs of `batch`; returns the failures.
fn run(
    device: &Device,
    dtype: DType,
    batch: &Batch,
    seed: u64,
    specs: &[Spec],
    accept: impl Fn(&Error) -> bool,
) -> Vec<String> {
    burn_flash::testing::poison_outputs(true);
    let packing = batch.packing(device);
    let mut failures = Vec::new();
    for (n, &spec) in specs.iter().enumerate() {
        let packed = Packed::draw(batch, dtype, seed + n as u64, device);
        let got = try_flash_attention_varlen(
            packed.q.clone(),
            packed.k.clone(),
            packed.v.clone(),
            &packing,
            spec.options(None),
        )
        .expect("valid inputs");
        assert_eq!(
            got.dims(),
            [packing.total_queries(), batch.heads, batch.value_dim]
        );
        let err = error(
            &to_host(got),
            &packed.reference(batch, spec, None),
            batch.value_dim,
        );
        let label = format!("{dtype:?} {batch:?} {spec}");
        eprintln!("{label}: {err}");
        if !accept(&err) {
            failures.push(format!("{label}: {err}"));
        }
    }
    failures
}

/// The gradients of q, k and v through an autodiff `device` for each of `specs`; returns the
/// failures.
fn run_grads(
    device: &Device,
    dtype: DType,
    batch: &Batch,
    seed: u64,
    specs: &[Spec],
    dropout: Option<(f64, u64)>,
    accept: impl Fn(&Error) -> bool,
) -> Vec<String> {
    burn_flash::testing::poison_outputs(true);
    let packing = batch.packing(device);
    let mut failures = Vec::new();
    for (n, &spec) in specs.iter().enumerate() {
        let packed = Packed::draw(batch, dtype, seed + n as u64, device);
        let [q, k, v] = [&packed.q, &packed.k, &packed.v].map(|t| t.clone().require_grad());
        let out = try_flash_attention_varlen(
            q.clone(),
            k.clone(),
            v.clone(),
            &packing,
            dropout.map_or(spec.options(None), |(prob, seed)| {
                spec.options(None).with_dropout(prob, seed)
            }),
        )
        .expect("valid inputs");
        let grad_out =
            Tensor::<3>::random(out.dims(), Distribution::Normal(0.0, 1.0), device).cast(dtype);
        let grad_host = to_host(grad_out.clone());
        let grads = (out.clone() * grad_out).sum().backward();
        let expected_out = packed.reference(batch, spec, dropout);
        let expected = packed.reference_grads(batch, spec, dropout, &grad_host);
        let checks = [
            ("out", to_host(out), expected_out, batch.value_dim),
            (
                "dq",
                to_host(q.grad(&grads).expect("dq")),
                expected[0].clone(),
                batch.head_dim,
            ),
            (
                "dk",
                to_host(k.grad(&grads).expect("dk")),
                expected[1].clone(),
                batch.head_dim,
            ),
            (
                "dv",
                to_host(v.grad(&grads).expect("dv")),
                expected[2].clone(),
                batch.value_dim,
            ),
        ];
        for (what, got, expected, row) in checks {
            let err = error(&got, &expected, row);
            let label = format!("{dtype:?} {batch:?} {spec} dropout {dropout:?} {what}");
            eprintln!("{label}: {err}");
            if !accept(&err) {
                failures.push(format!("{label}: {err}"));
            }
        }
    }
    failures
}

/// Self-attention over lengths 37, 0, 1, 100 and 64 (within a block, none, one, several
/// blocks, whole blocks).
const LENGTHS: [usize; 5] = [37, 0, 1, 100, 64];

/// Cross lengths: more keys than queries and fewer (the first queries then see nothing, causal
/// bottom-right), keys without queries, queries without keys.
const CROSS: [(usize, usize); 5] = [(5, 90), (0, 7), (3, 0), (70, 33), (1, 1)];

mod wgpu {
    use super::*;
    use burn::tensor::Device;

    /// Tolerance of the f32 results, as in `forward_wgpu`.
    const TOLERANCE: f64 = 1e-4;

    fn accept(err: &Error) -> bool {
        err.finite() && err.relative <= TOLERANCE && err.max_abs <= TOLERANCE * err.ref_max.max(1.0)
    }

    /// The fused forward (untracked) on self-attention and cross lengths with grouped heads
    /// and a value dim of its own, and Burn's unfused attention through the padded batch (head
    /// dim 300, which no tile runs).
    #[test]
    fn packed_sequences_match_the_reference() {
        let device = Device::wgpu(Default::default());
        let mut failures = run(
            &device,
            DType::F32,
            &Batch::same(&LENGTHS, 4, 2, 32),
            10,
            &specs(),
            accept,
        );
        failures.extend(run(
            &device,
            DType::F32,
            &Batch::new(&CROSS, 4, 1, 64).value_dim(16),
            20,
            &specs(),
            accept,
        ));
        failures.extend(run(
            &device,
            DType::F32,
            &Batch::new(&[(9, 40), (33, 33), (2, 0)], 2, 2, 300),
            30,
            &padded_specs(),
            accept,
        ));
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// Gradients where q, k and v require them: the fused packed backward on self-attention
    /// and cross lengths, with dropout too, and the padded batch through Burn's unfused
    /// attention (head dim 300).
    #[test]
    fn packed_gradients_match_the_reference() {
        let device = Device::wgpu(Default::default()).autodiff();
        let mut failures = run_grads(
            &device,
            DType::F32,
            &Batch::same(&LENGTHS, 4, 2, 32),
            40,
            &specs(),
            None,
            accept,
        );
        failures.extend(run_grads(
            &device,
            DType::F32,
            &Batch::new(&CROSS, 2, 1, 32).value_dim(16),
            50,
            &specs(),
            None,
            accept,
        ));
        failures.extend(run_grads(
            &device,
            DType::F32,
            &Batch::new(&[(9, 40), (33, 33), (2, 0)], 2, 2, 300),
            55,
            &padded_specs(),
            None,
            accept,
        ));
        // Dropout: the packed backward regenerates the forward's decisions per sequence.
        failures.extend(run_grads(
            &device,
            DType::F32,
            &Batch::new(&CROSS, 2, 1, 32),
            60,
            &specs()[..2],
            Some((0.2, 0x5EED)),
            accept,
        ));
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// Rows that do not add up to the packing, lists of different lengths, and keys and values
    /// of different rows are refused.
    #[test]
    fn bad_packings_are_refused() {
        let device = Device::wgpu(Default::default());
        let x = |rows| Tensor::<3>::zeros([rows, 2, 16], &device);
        let packing = PackedSequences::new(&[3, 4], &device);
        let options = burn_flash::FlashAttentionOptions::new();
        assert_eq!(
            try_flash_attention_varlen(x(6), x(7), x(7), &packing, options).unwrap_err(),
            FlashAttentionError::PackedRows {
                input: "q",
                expected: 7,
                got: 6
            }
        );
        assert_eq!(
            try_flash_attention_varlen(x(7), x(8), x(8), &packing, options).unwrap_err(),
            FlashAttentionError::PackedRows {
                input: "k",
                expected: 7,
                got: 8
            }
        );
        assert_eq!(
            try_flash_attention_varlen(x(7), x(7), x(6), &packing, options).unwrap_err(),
            FlashAttentionError::KeyValueLengthMismatch { k: 7, v: 6 }
        );
        assert_eq!(
            PackedSequences::with_keys(&[1, 2], &[3], &device).unwrap_err(),
            FlashAttentionError::PackedLengths {
                queries: 2,
                keys: 1
            }
        );
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use crate::common::cuda::{cuda_device, has_tensor_cores};
    use common::unit_roundoff;

    /// The sanity bound of `lengths::cuda` in bf16.
    fn accept(err: &Error) -> bool {
        let u = unit_roundoff(DType::BF16);
        err.finite() && err.relative <= 4.0 * u && err.max_abs <= 8.0 * u * err.ref_max
    }

    /// The gradients' bound in bf16: `backward_cuda`'s sanity bound (16 units of roundoff on
    /// the global relative error; one wrong block gives O(1)).
    fn accept_grads(err: &Error) -> bool {
        err.finite() && err.relative <= 16.0 * unit_roundoff(DType::BF16)
    }

    /// The fused forward in bf16 on the tensor-core tile, head dims 64 and 128, lengths from 0
    /// to several thousand, and the gradients through the fused packed backward, against the f64
    /// reference of the same bf16 inputs.
    #[test]
    fn packed_sequences_match_the_reference_cuda() {
        let Some(device) = cuda_device("varlen::cuda::packed_sequences_match_the_reference_cuda")
        else {
            return;
        };
        assert!(has_tensor_cores(&device, DType::BF16));
        let lengths = [1000, 0, 1, 4100, 129, 2048];
        let mut failures = Vec::new();
        for head_dim in [64, 128] {
            let batch = Batch::same(&lengths, 8, 2, head_dim);
            failures.extend(run(&device, DType::BF16, &batch, 60, &specs(), accept));
            let cross = Batch::new(&[(16, 3000), (700, 300), (0, 5), (1, 1)], 8, 8, head_dim);
            failures.extend(run(&device, DType::BF16, &cross, 70, &specs(), accept));
        }
        let autodiff = device.autodiff();
        for (seed, batch) in [
            Batch::same(&[300, 0, 1, 517], 4, 2, 64),
            Batch::same(&[1000, 0, 1, 2100, 129], 4, 4, 128),
            Batch::new(&[(16, 900), (700, 300), (0, 5), (1, 1)], 4, 2, 128),
        ]
        .iter()
        .enumerate()
        {
            let seed = 80 + 10 * seed as u64;
            failures.extend(run_grads(
                &autodiff,
                DType::BF16,
                batch,
                seed,
                &specs(),
                None,
                accept_grads,
            ));
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// Small ragged packings for compute-sanitizer (`scripts/gpu-run.sh sanitize`): the fused
    /// forward and backward over lengths 0 to a few blocks, self-attention and cross, against
    /// the same references.
    #[test]
    fn sanitizer_shapes_varlen_cuda() {
        let Some(device) = cuda_device("varlen::cuda::sanitizer_shapes_varlen_cuda") else {
            return;
        };
        let mut failures = Vec::new();
        let batches = [
            Batch::same(&[70, 0, 1, 129], 4, 2, 64),
            Batch::new(&[(5, 200), (130, 60), (0, 3), (2, 0)], 4, 4, 128),
        ];
        for (n, batch) in batches.iter().enumerate() {
            failures.extend(run(
                &device,
                DType::BF16,
                batch,
                90 + n as u64,
                &specs(),
                accept,
            ));
            let autodiff = device.clone().autodiff();
            failures.extend(run_grads(
                &autodiff,
                DType::BF16,
                batch,
                95 + n as u64,
                &specs(),
                None,
                accept_grads,
            ));
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}
