//! `try_flash_attention_with_lengths` and `try_flash_attention_paged`: keys cut to
//! per-sequence lengths, contiguous or in shuffled pages, against an f64 reference that attends
//! each sequence over its own first keys (its diagonal placed on its own length), on every path
//! the calls can take: the fused forward reading the lengths (and the block table) on the
//! device, the mask built from them (the pages gathered) where a gradient is needed, and Burn's
//! unfused attention where the fused kernel cannot run. On wgpu (f32, the portable tile) and, with feature
//! `cuda`, on the tensor-core tile in bf16. Outputs are poisoned with NaN before the kernels
//! run.

use crate::common;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_flash::{
    FlashAttentionOptions, try_flash_attention_paged, try_flash_attention_with_lengths,
};
use common::{
    Error, Inputs, Problem, Spec, error, paper_alibi_slopes, reference_row_keys, tensor_from_host,
    to_host, widen,
};

/// Options of one case: the spec (causal, window, alignment) and ALiBi.
#[derive(Clone, Copy, Debug)]
struct Case {
    spec: Spec,
    alibi: bool,
}

impl Case {
    fn new(spec: Spec) -> Self {
        Self { spec, alibi: false }
    }

    fn alibi(self) -> Self {
        Self {
            alibi: true,
            ..self
        }
    }

    fn options(&self) -> FlashAttentionOptions {
        self.spec.options(None).with_alibi(self.alibi)
    }
}

/// The reference: sequence `b` attends over its first `min(lengths[b], seq_k)` keys (0 for a
/// negative length), with the diagonal, window and ALiBi distances of that length.
fn reference(inputs: &Inputs, lengths: &[i64], case: Case) -> Vec<f64> {
    let p = &inputs.problem;
    let (q, k, v) = (widen(&inputs.q), widen(&inputs.k), widen(&inputs.v));
    let (d, dv) = (p.head_dim, p.value_dim);
    let scale = 1.0 / (d as f64).sqrt();
    let slopes = paper_alibi_slopes(p.heads);
    let mut out = Vec::new();
    for b in 0..p.batch {
        let len = lengths[b].clamp(0, p.seq_k as i64) as usize;
        for h in 0..p.heads {
            let kv = p.kv_index(b * p.heads + h);
            let keys = &k[kv * p.seq_k * d..][..len * d];
            let values = &v[kv * p.seq_k * dv..][..len * dv];
            for i in 0..p.seq_q {
                let seen = case.spec.visible(i, p.seq_q, len);
                let diag = common::diagonal(i, p.seq_q, len, case.spec.top_left) as f64;
                let bias: Vec<f64> = (0..len)
                    .map(|j| -slopes[h] * (j as f64 - diag).abs())
                    .collect();
                let row = &q[((b * p.heads + h) * p.seq_q + i) * d..][..d];
                let bias = case.alibi.then_some(&bias[..]);
                let (o, _) =
                    reference_row_keys(row, keys, values, dv, &seen, scale, &case.spec, bias, None);
                out.extend(o);
            }
        }
    }
    out
}

/// The lengths as a device tensor of i32.
fn lengths_tensor(lengths: &[i64], device: &Device) -> Tensor<1, Int> {
    let values: Vec<i32> = lengths.iter().map(|&len| len as i32).collect();
    Tensor::<1, Int>::from_data(TensorData::new(values, [lengths.len()]), device)
}

/// `k` and `v` of `inputs` in pages of `page` rows, `[pages, page, kv_heads, dim]`, the pages
/// of each sequence shuffled among those of every other and two more pages than the sequences
/// use (their rows, and those past `seq_k`, hold a large finite value no reference sees), with
/// the block table `[batch, pages per sequence]`.
fn paged(inputs: &Inputs, page: usize, device: &Device) -> (Tensor<4>, Tensor<4>, Tensor<2, Int>) {
    let p = &inputs.problem;
    let per_sequence = p.seq_k.div_ceil(page);
    let pages = p.batch * per_sequence + 2;
    // A fixed shuffle: page `i` of the sequences' run goes to `(i · m + 3) mod pages`, `m` the
    // first from 7 up that is prime to the pool's size, so that no two pages meet (7 itself
    // would fold 320 pages of a pool of 322 onto 46).
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let m = (7..)
        .find(|&m| gcd(m, pages) == 1)
        .expect("a multiplier prime to the pool");
    let table: Vec<i32> = (0..p.batch * per_sequence)
        .map(|i| ((i * m + 3) % pages) as i32)
        .collect();
    let layout = |dense: &[f32], dim: usize| {
        let mut buffer = vec![1000.0f32; pages * page * p.kv_heads * dim];
        for b in 0..p.batch {
            for j in 0..p.seq_k {
                let physical = table[b * per_sequence + j / page] as usize;
                for h in 0..p.kv_heads {
                    let from = ((b * p.kv_heads + h) * p.seq_k + j) * dim;
                    let to = ((physical * page + j % page) * p.kv_heads + h) * dim;
                    buffer[to..to + dim].copy_from_slice(&dense[from..from + dim]);
                }
            }
        }
        tensor_from_host(
            &buffer,
            [pages, page, p.kv_heads, dim],
            inputs.dtype,
            device,
        )
    };
    let (k, v) = (
        layout(&inputs.k, p.head_dim),
        layout(&inputs.v, p.value_dim),
    );
    let table =
        Tensor::<2, Int>::from_data(TensorData::new(table, [p.batch, per_sequence]), device);
    (k, v, table)
}

/// Run every case of `cases` on fresh inputs of `problem` over `lengths` on `device`, the keys
/// and values contiguous or in pages of `page` rows, with `track` marking q as requiring a
/// gradient (the masked path); returns the failures.
#[allow(clippy::too_many_arguments)]
fn run(
    device: &Device,
    dtype: DType,
    problem: Problem,
    lengths: &[i64],
    page: Option<usize>,
    cases: &[Case],
    track: bool,
    accept: impl Fn(&Error) -> bool,
) -> Vec<String> {
    burn_flash::testing::poison_outputs(true);
    let mut failures = Vec::new();
    for (seed, case) in cases.iter().enumerate() {
        let inputs = Inputs::random(problem, dtype, 900 + seed as u64);
        let [q, k, v] = inputs.to_device(device);
        let q = if track { q.require_grad() } else { q };
        let key_lengths = lengths_tensor(lengths, device);
        let got = match page {
            None => try_flash_attention_with_lengths(q, k, v, key_lengths, case.options()),
            Some(page) => {
                let (k, v, table) = paged(&inputs, page, device);
                try_flash_attention_paged(q, k, v, table, key_lengths, case.options())
            }
        }
        .expect("valid inputs");
        assert_eq!(got.dims(), problem.out_dims());
        let err = error(
            &to_host(got),
            &reference(&inputs, lengths, *case),
            problem.value_dim,
        );
        let label = format!(
            "{dtype:?} {problem:?} lengths {lengths:?} pages {page:?} {case:?} tracked {track}"
        );
        eprintln!("{label}: {err}");
        if !accept(&err) {
            failures.push(format!("{label}: {err}"));
        }
    }
    failures
}

/// Causal and not, a window, top-left, ALiBi.
fn cases(alibi: bool) -> Vec<Case> {
    let window = Spec {
        causal: true,
        left: Some(20),
        ..Spec::default()
    };
    let mut cases = vec![
        Case::new(Spec::from(true)),
        Case::new(Spec::from(false)),
        Case::new(window),
        Case::new(Spec::from(true).top_left()),
    ];
    if alibi {
        cases.push(Case::new(Spec::from(true)).alibi());
    }
    cases
}

/// Lengths 0, 1, within a block, a negative one (0), one past the keys (all of them).
const LENGTHS: [i64; 5] = [0, 1, 37, -4, 500];

mod wgpu {
    use super::*;
    use burn_flash::FlashAttentionError;

    /// Tolerance of the f32 results, as in `forward_wgpu`.
    const TOLERANCE: f64 = 1e-4;

    fn accept(err: &Error) -> bool {
        err.finite() && err.relative <= TOLERANCE && err.max_abs <= TOLERANCE * err.ref_max.max(1.0)
    }

    /// One query and a chunk of three per sequence, grouped heads, contiguous and in pages of
    /// 64, on the fused forward (untracked), on the mask (q requires a gradient: pages
    /// gathered), and on Burn's unfused attention (head dim 300, which no tile runs).
    #[test]
    fn lengths_match_the_reference_on_every_path() {
        let device = Device::wgpu(Default::default());
        let autodiff = device.clone().autodiff();
        let mut failures = Vec::new();
        for page in [None, Some(64)] {
            for seq_q in [1, 3] {
                let problem = Problem::cross(5, 4, seq_q, 192, 32).grouped(2);
                let fused = run(
                    &device,
                    DType::F32,
                    problem,
                    &LENGTHS,
                    page,
                    &cases(true),
                    false,
                    accept,
                );
                let masked = run(
                    &autodiff,
                    DType::F32,
                    problem,
                    &LENGTHS,
                    page,
                    &cases(false),
                    true,
                    accept,
                );
                failures.extend(fused.into_iter().chain(masked));
            }
            let wide = Problem::cross(3, 2, 2, 128, 300);
            failures.extend(run(
                &device,
                DType::F32,
                wide,
                &[1, 128, 17],
                page,
                &cases(false),
                false,
                accept,
            ));
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// Lengths of another size are refused, pages that do not pair up or hold no whole blocks
    /// and tables of another batch too; ALiBi is refused where the lengths become a mask.
    #[test]
    fn bad_lengths_and_options_are_refused() {
        let device = Device::wgpu(Default::default());
        let x = || Tensor::<4>::zeros([2, 2, 1, 16], &device);
        let three = lengths_tensor(&[1, 2, 3], &device);
        assert_eq!(
            try_flash_attention_with_lengths(x(), x(), x(), three, FlashAttentionOptions::new())
                .unwrap_err(),
            FlashAttentionError::KeyLengthsShape {
                expected: 2,
                got: 3
            }
        );
        let pages = |page, dim| Tensor::<4>::zeros([3, page, 2, dim], &device);
        let table = |batch| Tensor::<2, Int>::zeros([batch, 2], &device);
        let paged = |k, v, table, options| {
            let lengths = lengths_tensor(&[1, 2], &device);
            try_flash_attention_paged(x(), k, v, table, lengths, options).unwrap_err()
        };
        let options = FlashAttentionOptions::new();
        assert!(matches!(
            paged(pages(64, 16), pages(128, 16), table(2), options),
            FlashAttentionError::PagesShape { .. }
        ));
        assert_eq!(
            paged(pages(48, 16), pages(48, 16), table(2), options),
            FlashAttentionError::PageSize(48)
        );
        assert_eq!(
            paged(pages(64, 16), pages(64, 16), table(3), options),
            FlashAttentionError::BlockTableShape {
                expected: 2,
                got: vec![3, 2]
            }
        );
        let autodiff = device.autodiff();
        let q = Tensor::<4>::zeros([2, 2, 1, 16], &autodiff).require_grad();
        let k = Tensor::<4>::zeros([2, 2, 1, 16], &autodiff);
        let alibi = FlashAttentionOptions::causal().with_alibi(true);
        let lengths = lengths_tensor(&[1, 0], &autodiff);
        assert!(matches!(
            try_flash_attention_with_lengths(q, k.clone(), k, lengths, alibi),
            Err(FlashAttentionError::KeyLengthsOptions(_))
        ));
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use crate::common::cuda::{cuda_device, has_tensor_cores, has_tma};
    use common::unit_roundoff;

    /// The sanity bound of `cache::cuda` (`forward_cuda`'s) in bf16.
    fn accept(err: &Error) -> bool {
        let u = unit_roundoff(DType::BF16);
        err.finite() && err.relative <= 4.0 * u && err.max_abs <= 8.0 * u * err.ref_max
    }

    /// [`run`] in bf16 by [`accept`] on each of `problems`, contiguous and in shuffled pages
    /// of `page` rows: the failures.
    fn contiguous_and_paged(
        device: &Device,
        problems: &[Problem],
        lengths: &[i64],
        page: usize,
        cases: &[Case],
    ) -> Vec<String> {
        [None, Some(page)]
            .into_iter()
            .flat_map(|page| {
                problems.iter().flat_map(move |&problem| {
                    run(
                        device,
                        DType::BF16,
                        problem,
                        lengths,
                        page,
                        cases,
                        false,
                        accept,
                    )
                })
            })
            .collect()
    }

    /// The fused forward in bf16 on the tensor-core tile (decode shapes: grouped heads packed
    /// into rows, keys split across cubes), contiguous and in shuffled pages of 256, against the
    /// f64 reference of the same bf16 inputs, by [`accept`].
    #[test]
    fn lengths_match_the_reference_cuda() {
        let Some(device) = cuda_device("lengths::cuda::lengths_match_the_reference_cuda") else {
            return;
        };
        assert!(has_tensor_cores(&device, DType::BF16));
        let lengths = [0, 1, 37, 64, 5000, 2047, -4, 100_000];
        let problems = [(1, 128), (1, 64), (4, 128), (40, 64)]
            .map(|(seq_q, head_dim)| Problem::cross(8, 8, seq_q, 4096, head_dim).grouped(2));
        let failures = contiguous_and_paged(&device, &problems, &lengths, 256, &cases(true));
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// Small ragged shapes for compute-sanitizer (`scripts/gpu-run.sh sanitize`): lengths 0
    /// to past the keys, contiguous and in shuffled pages of 64, one query and a chunk of five,
    /// keys split across cubes, against the same reference.
    #[test]
    fn sanitizer_shapes_lengths_cuda() {
        let Some(device) = cuda_device("lengths::cuda::sanitizer_shapes_lengths_cuda") else {
            return;
        };
        let lengths = [0, 1, 70, 129, 320, -2];
        let problems = [1, 5].map(|seq_q| Problem::cross(6, 4, seq_q, 320, 64).grouped(2));
        let cases = [Case::new(Spec::from(true))];
        let failures = contiguous_and_paged(&device, &problems, &lengths, 64, &cases);
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// 512 row blocks (batch 64, 8 key/value heads of 4 packed query rows), more than one wave
    /// of two-stage 64-key cubes on an H100 or H200: the plan stages 32 keys at a time there,
    /// and under [`force_three_kv_stages`](burn_flash::testing::force_three_kv_stages) three
    /// 64-key stages. Ragged lengths walk 0, 1, 2 and more blocks (a three-stage ring's first
    /// two fetches come before its loop), contiguous and in shuffled pages of 64, and are small
    /// enough for the sanitizer.
    #[test]
    fn wide_decode_grids_match_the_reference_cuda() {
        let Some(device) = cuda_device("lengths::cuda::wide_decode_grids_match_the_reference_cuda")
        else {
            return;
        };
        let lengths: Vec<i64> = [0, 1, 70, 129, 300, -2, 64, 191]
            .into_iter()
            .cycle()
            .take(64)
            .collect();
        let cases = [Case::new(Spec::from(true)), Case::new(Spec::from(false))];
        let problems = [Problem::cross(64, 32, 1, 300, 128).grouped(8)];
        let failures = contiguous_and_paged(&device, &problems, &lengths, 64, &cases);
        assert!(failures.is_empty(), "{}", failures.join("\n"));

        let three = burn_flash::testing::force_three_kv_stages();
        let before = burn_flash::testing::three_stage_forward_launches();
        let failures = contiguous_and_paged(&device, &problems, &lengths, 64, &cases);
        let launches = burn_flash::testing::three_stage_forward_launches() - before;
        drop(three);
        assert!(failures.is_empty(), "three stages: {}", failures.join("\n"));
        eprintln!("three-stage forward launches: {launches}");
        if has_tma(&device) {
            // Other tests of the process may add theirs.
            assert!(launches >= 4, "the guard should have staged three deep");
        }
    }
}
