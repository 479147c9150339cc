//! Kernel-level tests on CubeCL's wgpu runtime (lavapipe in CI): the portable tile's forward and
//! backward launched on `KernelTensor`s and compared with a plain f64 reference computed here,
//! on fresh random inputs, with the outputs poisoned (NaN) before each launch.

mod backward;
mod forward;
#[cfg(feature = "cuda")]
mod hopper;
mod inputs;

use cubecl::Device;
use cubecl::prelude::*;

use super::ScoreParams;
use super::tensors::{KernelTensor, PackedRows};
use crate::{CausalAlignment, FlashAttentionOptions};

/// The client of the default wgpu device, outputs poisoned for every launch of this process.
pub fn client() -> Client {
    crate::testing::poison_outputs(true);
    Device::Wgpu(Default::default()).client()
}

/// A small counter-based generator (splitmix64), so the tests need no crate for randomness and
/// every case draws its own fresh values from its own seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (1.0 - self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }

    pub fn normals(&mut self, len: usize) -> Vec<f32> {
        (0..len).map(|_| self.normal() as f32).collect()
    }
}

/// One attention problem: `q [b, h, sq, d]`, `k [b, hkv, sk, d]`, `v [b, hkv, sk, dv]`, and
/// what hides keys.
#[derive(Clone, Debug)]
pub struct Case {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub head_dim: usize,
    pub value_dim: usize,
    pub options: FlashAttentionOptions,
    /// `[b|1, h|1, sq|1, sk]` dims of a boolean mask input (values drawn per case).
    pub mask: Option<[usize; 4]>,
    /// `[b|1, h|1, sq|1, sk]` dims of an additive bias input.
    pub bias: Option<[usize; 4]>,
    /// Each sequence's key length (`[b]`): only its first keys exist (none where negative).
    pub key_lengths: Option<Vec<i64>>,
    /// Keys and values in shuffled pages of this many rows, found through a block table.
    pub page_size: Option<usize>,
    /// The lengths and the block table reach the kernel as i32 (else u32).
    pub signed_indices: bool,
}

impl Case {
    pub fn new(batch: usize, heads: usize, seq_q: usize, seq_k: usize, head_dim: usize) -> Self {
        Self {
            batch,
            heads,
            kv_heads: heads,
            seq_q,
            seq_k,
            head_dim,
            value_dim: head_dim,
            options: FlashAttentionOptions::new(),
            mask: None,
            bias: None,
            key_lengths: None,
            page_size: None,
            signed_indices: false,
        }
    }

    pub fn causal(mut self) -> Self {
        self.options = self.options.with_causal(true);
        self
    }

    pub fn kv_heads(mut self, kv_heads: usize) -> Self {
        self.kv_heads = kv_heads;
        self
    }

    pub fn value_dim(mut self, value_dim: usize) -> Self {
        self.value_dim = value_dim;
        self
    }

    pub fn options(mut self, options: FlashAttentionOptions) -> Self {
        self.options = options;
        self
    }

    pub fn mask(mut self, dims: [usize; 4]) -> Self {
        self.mask = Some(dims);
        self
    }

    pub fn bias(mut self, dims: [usize; 4]) -> Self {
        self.bias = Some(dims);
        self
    }

    pub fn key_lengths(mut self, lengths: &[i64]) -> Self {
        assert_eq!(lengths.len(), self.batch);
        self.key_lengths = Some(lengths.to_vec());
        self
    }

    /// The lengths and the block table as i32, as Burn's integer tensors come by default.
    pub fn signed_indices(mut self) -> Self {
        self.signed_indices = true;
        self
    }

    /// Sequence `b`'s keys: its length, where the case has lengths, clamped into the rows.
    pub fn key_length(&self, b: usize) -> usize {
        self.key_lengths.as_ref().map_or(self.seq_k, |lengths| {
            lengths[b].clamp(0, self.seq_k as i64) as usize
        })
    }

    pub fn pages(mut self, page_size: usize) -> Self {
        assert!(self.key_lengths.is_some(), "a paged cache has lengths");
        self.page_size = Some(page_size);
        self
    }

    pub fn q_dims(&self) -> [usize; 4] {
        [self.batch, self.heads, self.seq_q, self.head_dim]
    }

    pub fn k_dims(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.seq_k, self.head_dim]
    }

    pub fn v_dims(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.seq_k, self.value_dim]
    }

    pub fn out_dims(&self) -> [usize; 4] {
        [self.batch, self.heads, self.seq_q, self.value_dim]
    }

    pub fn scale(&self) -> f64 {
        self.options.scale_for(self.head_dim)
    }
}

/// Host copies of one case's inputs.
pub struct Inputs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// 1 hides the pair.
    pub mask: Option<Vec<u32>>,
    pub bias: Option<Vec<f32>>,
}

fn len(dims: [usize; 4]) -> usize {
    dims.iter().product()
}

/// Index of `[b, h, i, j]` in a broadcast input of dims `dims`.
fn broadcast_index(dims: [usize; 4], b: usize, h: usize, i: usize, j: usize) -> usize {
    let at = |n: usize, dim: usize| if dims[dim] == 1 { 0 } else { n };
    ((at(b, 0) * dims[1] + at(h, 1)) * dims[2] + at(i, 2)) * dims[3] + j
}

impl Inputs {
    pub fn draw(case: &Case, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let q = rng.normals(len(case.q_dims()));
        let k = rng.normals(len(case.k_dims()));
        let v = rng.normals(len(case.v_dims()));
        // About a third of the pairs hidden, so that some rows lose every key.
        let mask = case.mask.map(|dims| {
            (0..len(dims))
                .map(|_| u32::from(rng.uniform() < 0.35))
                .collect()
        });
        let bias = case.bias.map(|dims| rng.normals(len(dims)));
        Self {
            q,
            k,
            v,
            mask,
            bias,
        }
    }

    /// The device tensors of these inputs: q, k, v and the score inputs.
    pub fn upload(
        &self,
        client: &Client,
        case: &Case,
    ) -> (KernelTensor, KernelTensor, KernelTensor, super::ScoreInputs) {
        let mask = self
            .mask
            .as_ref()
            .map(|m| KernelTensor::from_values(client, m, case.mask.unwrap()));
        let bias = self
            .bias
            .as_ref()
            .map(|b| KernelTensor::from_f32(client, b, case.bias.unwrap()));
        (
            KernelTensor::from_f32(client, &self.q, case.q_dims()),
            KernelTensor::from_f32(client, &self.k, case.k_dims()),
            KernelTensor::from_f32(client, &self.v, case.v_dims()),
            super::ScoreInputs::new(mask, bias),
        )
    }

    /// `k` and `v` as the forward reads them for `case`: as they are, or, where the case is
    /// paged, copied into shuffled pages (`[pages, kv_heads, page_size, dim]` views of
    /// `[pages, page_size, kv_heads, dim]` buffers, one page more than the sequences use, and
    /// every row no key fills NaN, so that a read of it shows); with the lengths and block table
    /// where the case has them.
    pub fn cached_keys(
        &self,
        client: &Client,
        case: &Case,
        k: KernelTensor,
        v: KernelTensor,
    ) -> (KernelTensor, KernelTensor, Option<super::CachedKeys>) {
        let Some(lengths) = &case.key_lengths else {
            return (k, v, None);
        };
        let indices = |values: Vec<i64>, dims: Vec<usize>| {
            if case.signed_indices {
                let values: Vec<i32> = values.iter().map(|&x| x as i32).collect();
                KernelTensor::from_values(client, &values, dims)
            } else {
                let values: Vec<u32> = values.iter().map(|&x| x as u32).collect();
                KernelTensor::from_values(client, &values, dims)
            }
        };
        let lengths = indices(lengths.clone(), vec![case.batch]);
        let Some(page) = case.page_size else {
            let cached = super::CachedKeys {
                lengths,
                block_table: None,
            };
            return (k, v, Some(cached));
        };
        let per_sequence = case.seq_k.div_ceil(page);
        let pages = case.batch * per_sequence + 1;
        // A shuffle of the pages (Fisher–Yates), so that no sequence's pages are in order.
        let mut order: Vec<u32> = (0..pages as u32).collect();
        let mut rng = Rng::new(page as u64 ^ 0xB10C);
        for i in (1..pages).rev() {
            order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let table: Vec<u32> = order[..case.batch * per_sequence].to_vec();
        let paged = |dense: &[f32], dim: usize| {
            let hkv = case.kv_heads;
            let mut buffer = vec![f32::NAN; pages * page * hkv * dim];
            for b in 0..case.batch {
                for logical in 0..per_sequence {
                    let physical = table[b * per_sequence + logical] as usize;
                    for r in 0..page.min(case.seq_k - logical * page) {
                        for h in 0..hkv {
                            let from = ((b * hkv + h) * case.seq_k + logical * page + r) * dim;
                            let to = ((physical * page + r) * hkv + h) * dim;
                            buffer[to..to + dim].copy_from_slice(&dense[from..from + dim]);
                        }
                    }
                }
            }
            let buffer = KernelTensor::from_f32(client, &buffer, [pages, page, hkv, dim]);
            KernelTensor::new(
                buffer.client,
                buffer.handle,
                [pages, hkv, page, dim],
                [page * hkv * dim, dim, hkv * dim, 1],
                buffer.dtype,
            )
        };
        let cached = super::CachedKeys {
            lengths,
            block_table: Some(indices(
                table.iter().map(|&page| page as i64).collect(),
                vec![case.batch, per_sequence],
            )),
        };
        (
            paged(&self.k, case.head_dim),
            paged(&self.v, case.value_dim),
            Some(cached),
        )
    }

    /// The keys query `i` of `(b, h)` sees: those of its sequence's length, the band of the
    /// options (aligned bottom-right on that length, or top-left), then the mask.
    fn seen(&self, case: &Case, b: usize, h: usize, i: usize) -> Vec<usize> {
        let seq_k = case.key_length(b);
        let diag = match case.options.causal_alignment {
            CausalAlignment::BottomRight => i as i64 + seq_k as i64 - case.seq_q as i64,
            CausalAlignment::TopLeft => i as i64,
        };
        let window = case.options.window.unwrap_or_default();
        (0..seq_k)
            .filter(|&j| {
                let j = j as i64;
                let right = if case.options.causal {
                    Some(0)
                } else {
                    window.right.map(|r| r as i64)
                };
                right.is_none_or(|r| j <= diag + r)
                    && window.left.is_none_or(|l| j >= diag - l as i64)
            })
            .filter(|&j| {
                self.mask
                    .as_ref()
                    .is_none_or(|mask| mask[broadcast_index(case.mask.unwrap(), b, h, i, j)] == 0)
            })
            .collect()
    }

    /// Row `i` of `(b, h)`: the probabilities of the seen keys (empty when none is seen or the
    /// bias hides them all) and the log-sum-exp of the scores.
    fn probs(&self, case: &Case, b: usize, h: usize, i: usize) -> (Vec<usize>, Vec<f64>, f64) {
        let (d, group) = (case.head_dim, case.heads / case.kv_heads);
        let q = &self.q[((b * case.heads + h) * case.seq_q + i) * d..][..d];
        let kv = b * case.kv_heads + h / group;
        let seen = self.seen(case, b, h, i);
        let scores: Vec<f64> = seen
            .iter()
            .map(|&j| {
                let key = &self.k[(kv * case.seq_k + j) * d..][..d];
                let dot: f64 = q.iter().zip(key).map(|(a, b)| *a as f64 * *b as f64).sum();
                let bias = self.bias.as_ref().map_or(0.0, |bias| {
                    bias[broadcast_index(case.bias.unwrap(), b, h, i, j)] as f64
                });
                case.scale() * dot + bias
            })
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if max == f64::NEG_INFINITY {
            return (Vec::new(), Vec::new(), f64::NEG_INFINITY);
        }
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = weights.iter().sum();
        (
            seen,
            weights.iter().map(|w| w / sum).collect(),
            max + sum.ln(),
        )
    }

    /// The f64 reference forward: the output `[b, h, sq, dv]` and log-sum-exp `[b, h, sq]`
    /// (`-inf` for rows that see no key, whose output is 0).
    pub fn forward(&self, case: &Case) -> (Vec<f64>, Vec<f64>) {
        let (dv, group) = (case.value_dim, case.heads / case.kv_heads);
        let mut out = Vec::with_capacity(len(case.out_dims()));
        let mut lse = Vec::new();
        for b in 0..case.batch {
            for h in 0..case.heads {
                let kv = b * case.kv_heads + h / group;
                for i in 0..case.seq_q {
                    let (seen, probs, row_lse) = self.probs(case, b, h, i);
                    let mut row = vec![0.0; dv];
                    for (&j, p) in seen.iter().zip(&probs) {
                        let value = &self.v[(kv * case.seq_k + j) * dv..][..dv];
                        for (o, x) in row.iter_mut().zip(value) {
                            *o += p * *x as f64;
                        }
                    }
                    out.extend(row);
                    lse.push(row_lse);
                }
            }
        }
        (out, lse)
    }

    /// The f64 reference gradients of `sum(d_out ∘ attention)`: `P = softmax(S)`,
    /// `dV = Pᵀ·dO`, `dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O))`, `dQ = scale·dS·K`, `dK = scale·dSᵀ·Q`,
    /// key/value gradients summed over the query heads of a group.
    pub fn grads(&self, case: &Case, d_out: &[f32]) -> [Vec<f64>; 3] {
        let (d, dv, group) = (case.head_dim, case.value_dim, case.heads / case.kv_heads);
        let mut dq = vec![0.0; self.q.len()];
        let mut dk = vec![0.0; self.k.len()];
        let mut d_v = vec![0.0; self.v.len()];
        for b in 0..case.batch {
            for h in 0..case.heads {
                let kv = b * case.kv_heads + h / group;
                for i in 0..case.seq_q {
                    let (seen, probs, _) = self.probs(case, b, h, i);
                    let row = (b * case.heads + h) * case.seq_q + i;
                    let g = &d_out[row * dv..][..dv];
                    let dp: Vec<f64> = seen
                        .iter()
                        .map(|&j| {
                            let value = &self.v[(kv * case.seq_k + j) * dv..][..dv];
                            g.iter()
                                .zip(value)
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum()
                        })
                        .collect();
                    let row_dot: f64 = probs.iter().zip(&dp).map(|(p, x)| p * x).sum();
                    for (n, &j) in seen.iter().enumerate() {
                        let ds = probs[n] * (dp[n] - row_dot) * case.scale();
                        let key = (kv * case.seq_k + j) * d;
                        for c in 0..d {
                            dq[row * d + c] += ds * self.k[key + c] as f64;
                            dk[key + c] += ds * self.q[row * d + c] as f64;
                        }
                        for c in 0..dv {
                            d_v[(kv * case.seq_k + j) * dv + c] += probs[n] * g[c] as f64;
                        }
                    }
                }
            }
        }
        [dq, dk, d_v]
    }
}

/// Sequences of different lengths, each a one-sequence [`Case`] with its own inputs, packed
/// along the rows (`[total, heads, dim]`) for the packed launches.
pub struct PackedBatch {
    pub sequences: Vec<(Case, Inputs)>,
}

impl PackedBatch {
    /// Sequences of these (query, key) lengths with `shape`'s heads, dims and options, each
    /// drawing fresh inputs from `seed` on.
    pub fn draw(lengths: &[(usize, usize)], shape: &Case, seed: u64) -> Self {
        let sequences = lengths
            .iter()
            .enumerate()
            .map(|(s, &(seq_q, seq_k))| {
                let case = Case {
                    batch: 1,
                    seq_q,
                    seq_k,
                    ..shape.clone()
                };
                let inputs = Inputs::draw(&case, seed + s as u64);
                (case, inputs)
            })
            .collect();
        Self { sequences }
    }

    fn shape(&self) -> &Case {
        &self.sequences[0].0
    }

    pub fn total_q(&self) -> usize {
        self.sequences.iter().map(|(c, _)| c.seq_q).sum()
    }

    pub fn total_k(&self) -> usize {
        self.sequences.iter().map(|(c, _)| c.seq_k).sum()
    }

    /// Each sequence's `[1, heads, rows, dim]` values (`rows` of its case) packed into
    /// `[total, heads, dim]`.
    pub fn pack<T: Copy>(
        &self,
        parts: &[&[T]],
        rows: fn(&Case) -> usize,
        heads: usize,
        dim: usize,
    ) -> Vec<T> {
        let mut packed = Vec::new();
        for ((case, _), part) in self.sequences.iter().zip(parts) {
            for row in 0..rows(case) {
                for head in 0..heads {
                    let at = (head * rows(case) + row) * dim;
                    packed.extend_from_slice(&part[at..at + dim]);
                }
            }
        }
        packed
    }

    /// Each sequence's `[1, heads, rows, dim]` values in the packed launches' `[1, heads,
    /// total, dim]` order.
    pub fn by_head(
        &self,
        parts: &[Vec<f64>],
        rows: fn(&Case) -> usize,
        heads: usize,
        dim: usize,
    ) -> Vec<f64> {
        let total: usize = self.sequences.iter().map(|(c, _)| rows(c)).sum();
        let mut out = vec![0.0; heads * total * dim];
        let mut first = 0;
        for ((case, _), part) in self.sequences.iter().zip(parts) {
            let n = rows(case);
            for head in 0..heads {
                let from = head * n * dim;
                let to = (head * total + first) * dim;
                out[to..to + n * dim].copy_from_slice(&part[from..from + n * dim]);
            }
            first += n;
        }
        out
    }

    /// `[total, heads, dim]` host values as the `[1, heads, total, dim]` view the launches read.
    pub fn upload_rows(
        client: &Client,
        values: &[f32],
        rows: usize,
        heads: usize,
        dim: usize,
    ) -> KernelTensor {
        KernelTensor::from_f32(client, values, [1, rows, heads, dim]).swapped(1, 2)
    }

    /// q, k and v packed on the device, and where their sequences lie.
    pub fn upload(
        &self,
        client: &Client,
    ) -> (KernelTensor, KernelTensor, KernelTensor, PackedRows) {
        let shape = self.shape();
        let (h, hkv, d, dv) = (shape.heads, shape.kv_heads, shape.head_dim, shape.value_dim);
        let side = |part: fn(&Inputs) -> &[f32], rows: fn(&Case) -> usize, heads, dim| {
            let parts: Vec<&[f32]> = self.sequences.iter().map(|(_, i)| part(i)).collect();
            let total = self.sequences.iter().map(|(c, _)| rows(c)).sum();
            Self::upload_rows(
                client,
                &self.pack(&parts, rows, heads, dim),
                total,
                heads,
                dim,
            )
        };
        let q = side(|i| &i.q, |c| c.seq_q, h, d);
        let k = side(|i| &i.k, |c| c.seq_k, hkv, d);
        let v = side(|i| &i.v, |c| c.seq_k, hkv, dv);
        let n = self.sequences.len();
        let mut starts = vec![0u32; 2 * (n + 1)];
        for (s, (case, _)) in self.sequences.iter().enumerate() {
            starts[s + 1] = starts[s] + case.seq_q as u32;
            starts[n + 2 + s] = starts[n + 1 + s] + case.seq_k as u32;
        }
        let packed = PackedRows {
            starts: KernelTensor::from_values(client, &starts, [2, n + 1]),
            max_query: self
                .sequences
                .iter()
                .map(|(c, _)| c.seq_q)
                .max()
                .unwrap_or(0),
            max_key: self
                .sequences
                .iter()
                .map(|(c, _)| c.seq_k)
                .max()
                .unwrap_or(0),
        };
        (q, k, v, packed)
    }

    /// The kernel parameters of the shape's options over the longest sequence.
    pub fn params(&self) -> ScoreParams {
        let shape = self.shape();
        let max = |rows: fn(&Case) -> usize| self.sequences.iter().map(|(c, _)| rows(c)).max();
        ScoreParams::new(
            &shape.options,
            shape.heads,
            shape.head_dim,
            max(|c| c.seq_q).unwrap_or(0),
            max(|c| c.seq_k).unwrap_or(0),
        )
        .with_key_lengths(&shape.options)
    }
}

/// The largest difference between `got` and `expected`, over the largest magnitude of
/// `expected` (at least 1); NaN anywhere in `got` fails at once, and `-inf` must match `-inf`.
pub fn assert_close(label: &str, got: &[f32], expected: &[f64], tolerance: f64) {
    assert_eq!(got.len(), expected.len(), "{label}: length");
    let scale = expected
        .iter()
        .filter(|x| x.is_finite())
        .fold(1.0f64, |m, x| m.max(x.abs()));
    let mut worst = (0.0f64, 0);
    for (n, (g, e)) in got.iter().zip(expected).enumerate() {
        let g = *g as f64;
        assert!(!g.is_nan(), "{label}: NaN at {n} (expected {e})");
        if e.is_infinite() || g.is_infinite() {
            assert_eq!(g, *e, "{label}: at {n}");
            continue;
        }
        let err = (g - e).abs() / scale;
        if err > worst.0 {
            worst = (err, n);
        }
    }
    assert!(
        worst.0 <= tolerance,
        "{label}: relative error {:.2e} at {} (got {}, expected {}), tolerance {tolerance:.0e}",
        worst.0,
        worst.1,
        got[worst.1],
        expected[worst.1]
    );
}
