//! Shared by the integration tests: an f64 CPU reference of attention, seeded random inputs and
//! error measures.
//!
//! The reference is written from the definition, independently of Burn and of the kernels:
//! for query row `i` of one (batch, head), `s_j = scale · q_i·k_j` over the keys `j` the row sees,
//! `out_i = Σ_j softmax(s)_j · v_j`, and `lse_i = ln Σ_j exp(s_j)`. With the causal mask the row
//! sees the keys `j <= i + (seq_k - seq_q)` (aligned bottom-right, as Burn's
//! `attention_fallback`); a row that sees no key has output 0 and log-sum-exp `-inf`.

#[cfg(feature = "cuda")]
pub mod cuda;

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_flash::{FlashAttentionPlan, TilePath};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sizes of one attention call: `q: [batch, heads, seq_q, head_dim]`,
/// `k: [batch, kv_heads, seq_k, head_dim]`, `v: [batch, kv_heads, seq_k, value_dim]`; query head
/// `h` reads key/value head `h / (heads / kv_heads)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Problem {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub head_dim: usize,
    pub value_dim: usize,
}

impl Problem {
    /// Self-attention sizes: `seq_q == seq_k`, `value_dim == head_dim`.
    pub fn square(batch: usize, heads: usize, seq: usize, head_dim: usize) -> Self {
        Self::cross(batch, heads, seq, seq, head_dim)
    }

    /// Different query and key lengths, `value_dim == head_dim`.
    pub fn cross(batch: usize, heads: usize, seq_q: usize, seq_k: usize, head_dim: usize) -> Self {
        Self {
            batch,
            heads,
            kv_heads: heads,
            seq_q,
            seq_k,
            head_dim,
            value_dim: head_dim,
        }
    }

    /// These sizes with values `value_dim` wide.
    pub fn with_value_dim(self, value_dim: usize) -> Self {
        Self { value_dim, ..self }
    }

    /// These sizes with `kv_heads` key/value heads (grouped-query attention).
    pub fn grouped(self, kv_heads: usize) -> Self {
        assert!(self.heads.is_multiple_of(kv_heads));
        Self { kv_heads, ..self }
    }

    /// Which `[batch, kv_heads]` slab of `k` and `v` the flattened `[batch, heads]` index `bh`
    /// of `q` reads.
    pub fn kv_index(&self, bh: usize) -> usize {
        let (b, h) = (bh / self.heads, bh % self.heads);
        b * self.kv_heads + h / (self.heads / self.kv_heads)
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
}

impl core::fmt::Display for Problem {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "b {} h {} seq_q {} seq_k {} d {}",
            self.batch, self.heads, self.seq_q, self.seq_k, self.head_dim
        )?;
        if self.kv_heads != self.heads {
            write!(f, " hkv {}", self.kv_heads)?;
        }
        if self.value_dim != self.head_dim {
            write!(f, " dv {}", self.value_dim)?;
        }
        Ok(())
    }
}

/// How many keys query row `i` sees: all of them, or with the causal mask aligned bottom-right
/// the keys `j <= i + seq_k - seq_q` (possibly none when `seq_k < seq_q`).
pub fn visible_keys(i: usize, seq_q: usize, seq_k: usize, causal: bool) -> usize {
    Spec::from(causal).visible(i, seq_q, seq_k).len()
}

/// What an attention call does to its scores besides the scale, written from the definitions
/// (independently of the library's options): the causal mask and a band `[diag - left,
/// diag + right]` around the diagonal `diag = i + seq_k - seq_q` (bottom-right aligned) or, with
/// `top_left`, `diag = i`, and the softcap `cap · tanh(s / cap)` of the scaled scores.
/// `false`/`true` convert to plain or causal attention.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Spec {
    pub causal: bool,
    pub left: Option<usize>,
    pub right: Option<usize>,
    pub softcap: Option<f64>,
    pub top_left: bool,
}

impl From<bool> for Spec {
    fn from(causal: bool) -> Self {
        Self {
            causal,
            ..Self::default()
        }
    }
}

impl Spec {
    /// Whether query `i` sees key `j`.
    pub fn sees(&self, i: usize, j: usize, seq_q: usize, seq_k: usize) -> bool {
        let diag = diagonal(i, seq_q, seq_k, self.top_left);
        let j = j as i64;
        (!self.causal || j <= diag)
            && self.left.is_none_or(|left| j >= diag - left as i64)
            && self.right.is_none_or(|right| j <= diag + right as i64)
    }

    /// The keys query `i` sees, in order.
    pub fn visible(&self, i: usize, seq_q: usize, seq_k: usize) -> Vec<usize> {
        (0..seq_k)
            .filter(|&j| self.sees(i, j, seq_q, seq_k))
            .collect()
    }

    /// A scaled score after the softcap, and the softcap's derivative there.
    pub fn cap(&self, score: f64) -> (f64, f64) {
        match self.softcap {
            None => (score, 1.0),
            Some(cap) => {
                let t = (score / cap).tanh();
                (cap * t, 1.0 - t * t)
            }
        }
    }

    /// The library's options for this spec and scale.
    pub fn options(&self, scale: Option<f64>) -> burn_flash::FlashAttentionOptions {
        let mut options = burn_flash::FlashAttentionOptions::new().with_causal(self.causal);
        if self.left.is_some() || self.right.is_some() {
            options = options.with_window(burn_flash::AttentionWindow::new(self.left, self.right));
        }
        if let Some(cap) = self.softcap {
            options = options.with_softcap(cap);
        }
        if let Some(scale) = scale {
            options = options.with_scale(scale);
        }
        if self.top_left {
            options = options.with_causal_alignment(burn_flash::CausalAlignment::TopLeft);
        }
        options
    }

    /// This spec with the diagonal aligned top-left.
    pub fn top_left(self) -> Self {
        Self {
            top_left: true,
            ..self
        }
    }
}

/// The key on query `i`'s diagonal: `i + seq_k - seq_q` (bottom-right) or `i` (top-left).
pub fn diagonal(i: usize, seq_q: usize, seq_k: usize, top_left: bool) -> i64 {
    if top_left {
        i as i64
    } else {
        i as i64 + seq_k as i64 - seq_q as i64
    }
}

impl core::fmt::Display for Spec {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "causal {}", self.causal)?;
        if self.left.is_some() || self.right.is_some() {
            write!(f, " window {:?}..{:?}", self.left, self.right)?;
        }
        if let Some(cap) = self.softcap {
            write!(f, " softcap {cap}")?;
        }
        if self.top_left {
            write!(f, " top-left")?;
        }
        Ok(())
    }
}

/// The per-score inputs of a call as the reference sees them, expanded to
/// `[batch, heads, seq_q, seq_k]` row-major: the pairs a boolean mask hides, an additive bias
/// (added after the scale and the softcap), and dropout's factor of each probability (0 or the
/// rescale, applied after the softmax). `Default` is none of them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scores {
    pub hidden: Option<Vec<bool>>,
    pub bias: Option<Vec<f64>>,
    pub keep: Option<Vec<f64>>,
}

/// ALiBi's slopes for `n` heads as the paper's code (`get_slopes` of ofirpress/attention_with_linear_biases)
/// computes them: a geometric sequence from `2^(−8/n)` for a power of two, else the sequence of
/// the largest power of two below `n` followed by every other slope of twice that.
pub fn paper_alibi_slopes(n: usize) -> Vec<f64> {
    let geometric = |n: usize| {
        let start = 2f64.powf(-(2f64.powf(-((n as f64).log2() - 3.0))));
        (0..n)
            .map(|i| start * start.powi(i as i32))
            .collect::<Vec<_>>()
    };
    if n.is_power_of_two() {
        return geometric(n);
    }
    let below = 1 << n.ilog2();
    let mut slopes = geometric(below);
    slopes.extend(
        paper_alibi_slopes(2 * below)
            .into_iter()
            .step_by(2)
            .take(n - below),
    );
    slopes
}

/// ALiBi's bias over the full scores `[batch, heads, seq_q, seq_k]`: `−slope_h · |j − diag(i)|`,
/// `diag(i) = i + seq_k − seq_q`, or `i` with `top_left`.
pub fn alibi_scores(p: &Problem, top_left: bool) -> Vec<f64> {
    let slopes = paper_alibi_slopes(p.heads);
    let (sq, sk) = (p.seq_q, p.seq_k);
    (0..p.batch * p.heads * sq * sk)
        .map(|at| {
            let (h, i, j) = (at / (sq * sk) % p.heads, at / sk % sq, at % sk);
            let diag = diagonal(i, sq, sk, top_left) as f64;
            -slopes[h] * (j as f64 - diag).abs()
        })
        .collect()
}

/// `lowbias32` (C. Wellons), as `docs/features.md` specifies dropout's generator.
fn lowbias32(value: u32) -> u32 {
    let mut x = value;
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// Dropout's keep threshold out of 2⁸ for probability `prob`, as documented.
pub fn dropout_threshold(prob: f64) -> u32 {
    let most = if prob > 0.0 { 255 } else { 256 };
    (((1.0 - prob) * 256.0).round() as u32).clamp(1, most)
}

/// Whether dropout of `prob` seeded by `seed` keeps query `i`, key `j` of flattened head `bh`
/// (`batch · heads + head`) over `seq_k` keys: the documented formula, written here from
/// `docs/features.md`.
pub fn dropout_keeps(seed: u64, prob: f64, bh: usize, i: usize, j: usize, seq_k: usize) -> bool {
    let (lo, hi) = (seed as u32, (seed >> 32) as u32);
    let head_key = lowbias32(lo ^ lowbias32(hi ^ lowbias32(bh as u32)));
    let group = (j / 16 * 4 + j / 2 % 4) as u32;
    let counter = (i as u32)
        .wrapping_mul((seq_k.div_ceil(16) * 4) as u32)
        .wrapping_add(group);
    let bits = lowbias32(counter.wrapping_add(head_key));
    let byte = (j % 2 + j / 8 % 2 * 2) as u32;
    (bits >> (8 * byte)) & 0xFF < dropout_threshold(prob)
}

impl Scores {
    /// These inputs with dropout of `prob` seeded by `seed`: factor 0 for dropped pairs,
    /// `2⁸ / threshold` for kept ones.
    pub fn with_dropout(self, p: &Problem, prob: f64, seed: u64) -> Self {
        self.with_dropout_at(p, prob, seed, 0, p.seq_k)
    }

    /// [`with_dropout`](Self::with_dropout) as drawn for `p`'s heads numbered from `first_bh`,
    /// with `row_keys` keys per row of the generator's counter (a packed batch's sequence: its
    /// batch entry's first head, the packing's total keys).
    pub fn with_dropout_at(
        self,
        p: &Problem,
        prob: f64,
        seed: u64,
        first_bh: usize,
        row_keys: usize,
    ) -> Self {
        let scale = 256.0 / dropout_threshold(prob) as f64;
        let (sq, sk) = (p.seq_q, p.seq_k);
        let keep = (0..p.batch * p.heads * sq * sk)
            .map(|at| {
                let (bh, i, j) = (first_bh + at / (sq * sk), at / sk % sq, at % sk);
                if dropout_keeps(seed, prob, bh, i, j, row_keys) {
                    scale
                } else {
                    0.0
                }
            })
            .collect();
        Self {
            keep: Some(keep),
            ..self
        }
    }

    /// Dropout's factors of query `i` of `bh`, indexed by key, if there is dropout.
    pub fn keep_row(&self, p: &Problem, bh: usize, i: usize) -> Option<&[f64]> {
        let row = (bh * p.seq_q + i) * p.seq_k;
        self.keep.as_deref().map(|keep| &keep[row..row + p.seq_k])
    }
}

impl Scores {
    /// The keys query `i` of the flattened (batch, head) `bh` sees: `spec`'s, less the hidden.
    pub fn seen(&self, p: &Problem, spec: &Spec, bh: usize, i: usize) -> Vec<usize> {
        let row = (bh * p.seq_q + i) * p.seq_k;
        spec.visible(i, p.seq_q, p.seq_k)
            .into_iter()
            .filter(|&j| self.hidden.as_ref().is_none_or(|hidden| !hidden[row + j]))
            .collect()
    }

    /// The bias row of query `i` of `bh`, indexed by key, if there is a bias.
    pub fn bias_row(&self, p: &Problem, bh: usize, i: usize) -> Option<&[f64]> {
        let row = (bh * p.seq_q + i) * p.seq_k;
        self.bias.as_deref().map(|bias| &bias[row..row + p.seq_k])
    }
}

/// Head dims the tensor-core tile serves besides 64 and 128 (32, 96, 256, with rows stored
/// padded in shared memory and, at 256, narrower blocks), and values of another width than
/// queries and keys; lengths that cross several blocks and end mid-block.
pub fn head_dim_problems() -> Vec<Problem> {
    vec![
        Problem::cross(1, 2, 65, 130, 32),
        Problem::square(2, 1, 200, 32),
        Problem::cross(1, 2, 130, 65, 96),
        Problem::square(1, 1, 200, 96).grouped(1),
        Problem::cross(1, 2, 65, 200, 256),
        Problem::cross(1, 4, 150, 77, 256).grouped(2),
        Problem::cross(1, 2, 70, 90, 64).with_value_dim(128),
        Problem::cross(1, 2, 90, 70, 128).with_value_dim(64),
        Problem::square(1, 1, 100, 96).with_value_dim(32),
    ]
}

/// Head dims the tensor-core tile is not built for, which the plan zero-pads to its next size
/// on the tensor cores (80 to 96, 160 and 192 to 256, 48 to 64), with values of another width
/// (192/128, as DeepSeek's attention) and grouped heads.
pub fn padded_head_dim_problems() -> Vec<Problem> {
    vec![
        Problem::cross(1, 2, 65, 130, 80),
        Problem::square(1, 4, 100, 80).grouped(2),
        Problem::cross(1, 2, 90, 70, 160),
        Problem::square(1, 2, 77, 192),
        Problem::cross(1, 2, 70, 90, 192).with_value_dim(128),
        Problem::cross(1, 2, 33, 40, 48),
    ]
}

/// `BURN_FLASH_WARPGROUP`, where set to 0 or 1: the Hopper forward never or wherever it runs.
pub fn warpgroup_override() -> Option<bool> {
    match std::env::var("BURN_FLASH_WARPGROUP").ok()?.trim() {
        "0" => Some(false),
        "1" => Some(true),
        _ => None,
    }
}

/// Whether `plan` is `expected`, or, under `BURN_FLASH_WARPGROUP=1` (the Hopper forward wherever
/// it runs), the Hopper forward in place of the tensor-core tile.
pub fn plan_is(plan: &FlashAttentionPlan, expected: &FlashAttentionPlan) -> bool {
    plan == expected
        || (*plan == FlashAttentionPlan::FusedWarpgroup
            && *expected == FlashAttentionPlan::Fused(TilePath::TensorCore)
            && warpgroup_override() == Some(true))
}

/// The plan a problem must get on a GPU whose bf16/f16 tile is `tile`: the tensor-core tile
/// zero-pads head dims it is not built for to its next size; the portable tile runs them.
pub fn expected_fused(tile: TilePath, problem: &Problem) -> FlashAttentionPlan {
    match tile {
        TilePath::TensorCore => padded_plan(tile, problem),
        TilePath::Portable => FlashAttentionPlan::Fused(tile),
    }
}

/// The fused plan on `tile` with the head dims zero-padded to the tensor-core tile's next
/// sizes (32, 64, 96, 128, 256) where they are not such a size already.
pub fn padded_plan(tile: TilePath, problem: &Problem) -> FlashAttentionPlan {
    const TENSOR_CORE_DIMS: [usize; 5] = [32, 64, 96, 128, 256];
    let next = |dim: usize| TENSOR_CORE_DIMS.into_iter().find(|&size| size >= dim);
    match (next(problem.head_dim), next(problem.value_dim)) {
        (Some(head_dim), Some(value_dim))
            if (head_dim, value_dim) != (problem.head_dim, problem.value_dim) =>
        {
            FlashAttentionPlan::FusedPadded {
                tile,
                head_dim,
                value_dim,
            }
        }
        _ => FlashAttentionPlan::Fused(tile),
    }
}

/// The feature cases the CUDA suites run at tensor-core head dims (the lavapipe suite,
/// `features_wgpu`, covers the same features on smaller sizes): grouped-query and multi-query
/// attention, causal and two-sided sliding windows across several KV blocks (also with fewer
/// keys than queries, so that rows see nothing), the softcap, all of them together, and the
/// top-left causal alignment.
pub fn feature_cases() -> Vec<(Problem, Spec)> {
    let band = |causal, left, right| Spec {
        causal,
        left,
        right,
        softcap: None,
        top_left: false,
    };
    let capped = Spec {
        softcap: Some(2.0),
        ..Spec::default()
    };
    let everything = Spec {
        causal: true,
        left: Some(70),
        right: None,
        softcap: Some(5.0),
        top_left: false,
    };
    vec![
        (
            Problem::cross(2, 4, 37, 70, 64).grouped(2),
            Spec::from(true),
        ),
        (
            Problem::square(1, 6, 130, 128).grouped(2),
            Spec::from(false),
        ),
        (
            Problem::cross(1, 4, 150, 90, 64).grouped(1),
            Spec::from(true),
        ),
        (Problem::square(1, 2, 300, 64), band(true, Some(40), None)),
        (
            Problem::square(1, 1, 300, 128),
            band(false, Some(64), Some(17)),
        ),
        (Problem::cross(1, 2, 200, 90, 64), band(true, Some(9), None)),
        (
            Problem::cross(1, 1, 90, 260, 128),
            band(false, Some(0), Some(0)),
        ),
        (Problem::square(1, 2, 150, 64), capped),
        (Problem::cross(1, 4, 177, 293, 128).grouped(2), everything),
        // Top-left alignment: fewer queries than keys (the keys past the last diagonal get no
        // gradient), and more, with a window.
        (
            Problem::cross(1, 2, 90, 200, 64),
            Spec::from(true).top_left(),
        ),
        (
            Problem::cross(1, 2, 210, 100, 128),
            band(true, Some(30), None).top_left(),
        ),
    ]
}

/// One query row of one (batch, head): `q_row` has `head_dim` values, `keys` and `values` hold
/// that head's `[seq_k, head_dim]` and `[seq_k, value_dim]` rows (row-major). Returns the output
/// row (`value_dim` values) and the natural log-sum-exp of the scaled scores over the first
/// `visible` keys; `(zeros, -inf)` when `visible == 0`.
pub fn reference_row(
    q_row: &[f64],
    keys: &[f64],
    values: &[f64],
    value_dim: usize,
    visible: usize,
    scale: f64,
) -> (Vec<f64>, f64) {
    let seen: Vec<usize> = (0..visible).collect();
    reference_row_keys(
        q_row,
        keys,
        values,
        value_dim,
        &seen,
        scale,
        &Spec::default(),
        None,
        None,
    )
}

/// [`reference_row`] over the keys `seen`, with `spec`'s softcap, a bias row (indexed by key)
/// added to the capped scores, and dropout's factors (indexed by key) applied to the
/// probabilities (the normaliser and the log-sum-exp are those of the whole row).
#[allow(clippy::too_many_arguments)]
pub fn reference_row_keys(
    q_row: &[f64],
    keys: &[f64],
    values: &[f64],
    value_dim: usize,
    seen: &[usize],
    scale: f64,
    spec: &Spec,
    bias: Option<&[f64]>,
    keep: Option<&[f64]>,
) -> (Vec<f64>, f64) {
    let head_dim = q_row.len();
    let mut out = vec![0.0; value_dim];
    if seen.is_empty() {
        return (out, f64::NEG_INFINITY);
    }
    let scores: Vec<f64> = seen
        .iter()
        .map(|&j| {
            let key = &keys[j * head_dim..(j + 1) * head_dim];
            spec.cap(scale * q_row.iter().zip(key).map(|(a, b)| a * b).sum::<f64>())
                .0
                + bias.map_or(0.0, |bias| bias[j])
        })
        .collect();
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        // A bias of -inf on every seen key hides the row.
        return (out, f64::NEG_INFINITY);
    }
    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = weights.iter().sum();
    for (&j, w) in seen.iter().zip(&weights) {
        let value = &values[j * value_dim..(j + 1) * value_dim];
        let w = w * keep.map_or(1.0, |keep| keep[j]);
        for (o, x) in out.iter_mut().zip(value) {
            *o += w * x;
        }
    }
    for o in &mut out {
        *o /= sum;
    }
    (out, max + sum.ln())
}

/// The reference of a whole call on row-major host copies of `q`, `k`, `v` (shapes as in
/// [`Problem`]). Returns the output `[batch, heads, seq_q, value_dim]` and the log-sum-exp
/// `[batch, heads, seq_q]`. `scale: None` means `1 / sqrt(head_dim)`.
pub fn reference_attention(
    p: &Problem,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    spec: impl Into<Spec>,
    scale: Option<f64>,
) -> (Vec<f64>, Vec<f64>) {
    reference_attention_scores(p, q, k, v, spec, scale, &Scores::default())
}

/// [`reference_attention`] with a mask and a bias.
pub fn reference_attention_scores(
    p: &Problem,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    spec: impl Into<Spec>,
    scale: Option<f64>,
    extra: &Scores,
) -> (Vec<f64>, Vec<f64>) {
    let spec = spec.into();
    assert_eq!(q.len(), p.q_dims().iter().product::<usize>());
    assert_eq!(k.len(), p.k_dims().iter().product::<usize>());
    assert_eq!(v.len(), p.v_dims().iter().product::<usize>());
    let scale = scale.unwrap_or(1.0 / (p.head_dim as f64).sqrt());
    let (d, dv) = (p.head_dim, p.value_dim);
    let mut out = Vec::with_capacity(p.out_dims().iter().product());
    let mut lse = Vec::with_capacity(p.batch * p.heads * p.seq_q);
    for bh in 0..p.batch * p.heads {
        let kv = p.kv_index(bh);
        let q_head = &q[bh * p.seq_q * d..(bh + 1) * p.seq_q * d];
        let k_head = &k[kv * p.seq_k * d..(kv + 1) * p.seq_k * d];
        let v_head = &v[kv * p.seq_k * dv..(kv + 1) * p.seq_k * dv];
        for i in 0..p.seq_q {
            let seen = extra.seen(p, &spec, bh, i);
            let (row, row_lse) = reference_row_keys(
                &q_head[i * d..(i + 1) * d],
                k_head,
                v_head,
                dv,
                &seen,
                scale,
                &spec,
                extra.bias_row(p, bh, i),
                extra.keep_row(p, bh, i),
            );
            out.extend(row);
            lse.push(row_lse);
        }
    }
    (out, lse)
}

/// Unit roundoff of a float dtype (half the distance from 1 to the next value).
pub fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => f64::EPSILON / 2.0,
        DType::F32 => f32::EPSILON as f64 / 2.0,
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        other => panic!("no unit roundoff for {other:?}"),
    }
}

/// Round an f32 to the nearest value of `dtype` (f16, bf16 or f32), returned as f32.
pub fn round_to(value: f32, dtype: DType) -> f32 {
    match dtype {
        DType::F32 => value,
        DType::F16 => half::f16::from_f32(value).to_f32(),
        DType::BF16 => half::bf16::from_f32(value).to_f32(),
        other => panic!("unsupported test dtype {other:?}"),
    }
}

/// `len` samples of a standard normal distribution from a seeded generator (Box–Muller),
/// rounded to `dtype`. Values of exactly 0 are redrawn, so inputs are never zeros.
pub fn random_normal(len: usize, seed: u64, dtype: DType) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut values = Vec::with_capacity(len);
    while values.len() < len {
        // 1 - [0, 1) is (0, 1], so the log is finite.
        let u1: f64 = 1.0 - rng.random::<f64>();
        let u2: f64 = rng.random::<f64>();
        let radius = (-2.0 * u1.ln()).sqrt();
        let angle = 2.0 * core::f64::consts::PI * u2;
        for sample in [radius * angle.cos(), radius * angle.sin()] {
            let rounded = round_to(sample as f32, dtype);
            if rounded != 0.0 && values.len() < len {
                values.push(rounded);
            }
        }
    }
    values
}

/// Host values widened to f64, for the reference.
pub fn widen(values: &[f32]) -> Vec<f64> {
    values.iter().map(|&x| x as f64).collect()
}

/// Host copies of `q`, `k` and `v` for a problem, already rounded to the dtype the device will
/// hold, so the reference sees exactly the values the kernels see.
pub struct Inputs {
    pub problem: Problem,
    pub dtype: DType,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl Inputs {
    /// Fresh standard-normal inputs; `seed` selects them (q, k and v use different streams).
    pub fn random(problem: Problem, dtype: DType, seed: u64) -> Self {
        let len = |dims: [usize; 4]| dims.iter().product::<usize>();
        let base = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        Self {
            problem,
            dtype,
            q: random_normal(len(problem.q_dims()), base ^ 1, dtype),
            k: random_normal(len(problem.k_dims()), base ^ 2, dtype),
            v: random_normal(len(problem.v_dims()), base ^ 3, dtype),
        }
    }

    /// The three tensors on a device, in `self.dtype` (exact: the values are representable).
    pub fn to_device(&self, device: &Device) -> [Tensor<4>; 3] {
        let p = &self.problem;
        [
            (&self.q, p.q_dims()),
            (&self.k, p.k_dims()),
            (&self.v, p.v_dims()),
        ]
        .map(|(values, dims)| tensor_from_host(values, dims, self.dtype, device))
    }

    /// The f64 reference output and log-sum-exp of these inputs.
    pub fn reference(&self, spec: impl Into<Spec>, scale: Option<f64>) -> (Vec<f64>, Vec<f64>) {
        reference_attention(
            &self.problem,
            &widen(&self.q),
            &widen(&self.k),
            &widen(&self.v),
            spec,
            scale,
        )
    }
}

/// A tensor of `dtype` holding `values` (which must be representable in `dtype`).
pub fn tensor_from_host(
    values: &[f32],
    dims: [usize; 4],
    dtype: DType,
    device: &Device,
) -> Tensor<4> {
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
    let tensor = Tensor::<4>::from_data(data, (device, dtype));
    assert_eq!(
        tensor.dtype(),
        dtype,
        "the tensor was not created in {dtype:?}"
    );
    tensor
}

/// A device tensor's values, widened to f64 (NaN stays NaN).
pub fn to_host<const D: usize>(tensor: Tensor<D>) -> Vec<f64> {
    tensor.into_data().iter::<f64>().collect()
}

/// How far a result is from the reference.
#[derive(Clone, Copy, Debug)]
pub struct Error {
    /// `‖got − ref‖₂ / ‖ref‖₂` over everything (the plain norm of the difference when the
    /// reference is all 0); infinite when `got` holds a NaN or an infinity.
    pub relative: f64,
    /// The worst row: `max_i ‖got_i − ref_i‖₂ / ‖ref_i‖₂` over output rows (the plain norm for a
    /// row whose reference is 0). Sensitive to a bug confined to one row, e.g. one key wrongly
    /// masked, which the global norm dilutes. Infinite with non-finite values.
    pub row_relative: f64,
    /// `max |got − ref|`; infinite when `got` holds a NaN or an infinity.
    pub max_abs: f64,
    /// `max |ref|`, for scale.
    pub ref_max: f64,
    /// Values of `got` that are NaN or infinite.
    pub non_finite: usize,
}

impl Error {
    /// Whether every value was finite (a NaN never passes).
    pub fn finite(&self) -> bool {
        self.non_finite == 0
    }
}

impl core::fmt::Display for Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "relative {:.3e}, worst row {:.3e}, max abs {:.3e} (max |ref| {:.3}), non-finite {}",
            self.relative, self.row_relative, self.max_abs, self.ref_max, self.non_finite
        )
    }
}

/// Compare `got` with `reference` element by element (same length, rows of `row_len` values).
/// A NaN or infinity in `got` makes every measure infinite, so no tolerance can accept it.
pub fn error(got: &[f64], reference: &[f64], row_len: usize) -> Error {
    assert_eq!(
        got.len(),
        reference.len(),
        "result and reference differ in length"
    );
    assert!(
        row_len > 0 && got.len().is_multiple_of(row_len),
        "rows of {row_len}"
    );
    let (mut diff_sq, mut ref_sq) = (0.0, 0.0);
    let (mut max_abs, mut ref_max, mut row_relative): (f64, f64, f64) = (0.0, 0.0, 0.0);
    let mut non_finite = 0;
    for (got_row, ref_row) in got.chunks(row_len).zip(reference.chunks(row_len)) {
        let (mut row_diff_sq, mut row_ref_sq) = (0.0, 0.0);
        for (&g, &r) in got_row.iter().zip(ref_row) {
            assert!(r.is_finite(), "the reference holds a non-finite value");
            if !g.is_finite() {
                non_finite += 1;
                continue;
            }
            let d = g - r;
            row_diff_sq += d * d;
            row_ref_sq += r * r;
            max_abs = max_abs.max(d.abs());
            ref_max = ref_max.max(r.abs());
        }
        diff_sq += row_diff_sq;
        ref_sq += row_ref_sq;
        let row = if row_ref_sq > 0.0 {
            (row_diff_sq / row_ref_sq).sqrt()
        } else {
            row_diff_sq.sqrt()
        };
        row_relative = row_relative.max(row);
    }
    let relative = if ref_sq > 0.0 {
        (diff_sq / ref_sq).sqrt()
    } else {
        diff_sq.sqrt()
    };
    if non_finite > 0 {
        return Error {
            relative: f64::INFINITY,
            row_relative: f64::INFINITY,
            max_abs: f64::INFINITY,
            ref_max,
            non_finite,
        };
    }
    Error {
        relative,
        row_relative,
        max_abs,
        ref_max,
        non_finite,
    }
}

/// Softmax of one row of scaled scores as Burn's fallback computes it in `dtype`: row max,
/// subtract, `exp`, row sum, divide, each result rounded.
fn rounded_softmax(scores: &[f32], dtype: DType) -> Vec<f32> {
    let round = |x: f32| round_to(x, dtype);
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = scores
        .iter()
        .map(|&s| round(round(s - max).exp()))
        .collect();
    let sum = round(exps.iter().sum::<f32>());
    exps.iter().map(|&e| round(e / sum)).collect()
}

/// Unfused attention of one query row in low precision, emulated on the CPU: the steps of
/// Burn's `attention_fallback` (`Q·Kᵀ`, `· scale`, mask, row max, subtract, `exp`, row sum,
/// divide, `P·V`), each result rounded to `dtype` as a tensor of that dtype would hold it, with
/// f32 accumulation inside the two products and the sum. The baseline of the FlashAttention test
/// rule where running Burn's own fallback on every shape would cost minutes of autotuning.
pub fn unfused_row(
    q_row: &[f32],
    keys: &[f32],
    values: &[f32],
    value_dim: usize,
    visible: usize,
    scale: f64,
    dtype: DType,
) -> Vec<f64> {
    let seen: Vec<usize> = (0..visible).collect();
    unfused_row_keys(
        q_row,
        keys,
        values,
        value_dim,
        &seen,
        scale,
        &Spec::default(),
        None,
        None,
        dtype,
    )
}

/// [`unfused_row`] over the keys `seen`, with `spec`'s softcap computed as Burn's fallback does
/// (divide, `tanh`, multiply, each rounded), a bias row (indexed by key, in the dtype) added
/// to the capped scores, rounded as Burn's fallback adds it, and dropout's factors applied to
/// the rounded probabilities (as a dropout after the softmax, rounded).
#[allow(clippy::too_many_arguments)]
pub fn unfused_row_keys(
    q_row: &[f32],
    keys: &[f32],
    values: &[f32],
    value_dim: usize,
    seen: &[usize],
    scale: f64,
    spec: &Spec,
    bias: Option<&[f64]>,
    keep: Option<&[f64]>,
    dtype: DType,
) -> Vec<f64> {
    let head_dim = q_row.len();
    let round = |x: f32| round_to(x, dtype);
    if seen.is_empty() {
        return vec![0.0; value_dim];
    }
    let scores: Vec<f32> = seen
        .iter()
        .map(|&j| {
            let key = &keys[j * head_dim..(j + 1) * head_dim];
            let dot = q_row.iter().zip(key).fold(0f32, |acc, (a, b)| acc + a * b);
            let capped = unfused_cap(round(round(dot) * round(scale as f32)), spec, dtype);
            bias.map_or(capped, |bias| round(capped + bias[j] as f32))
        })
        .collect();
    if scores.iter().all(|&s| s == f32::NEG_INFINITY) {
        return vec![0.0; value_dim];
    }
    let probs: Vec<f32> = rounded_softmax(&scores, dtype)
        .iter()
        .zip(seen)
        .map(|(&p, &j)| keep.map_or(p, |keep| round(p * keep[j] as f32)))
        .collect();
    (0..value_dim)
        .map(|c| {
            let acc = seen
                .iter()
                .zip(&probs)
                .fold(0f32, |acc, (&j, p)| acc + p * values[j * value_dim + c]);
            round(acc) as f64
        })
        .collect()
}

/// The softcap of a scaled score as Burn's fallback computes it in `dtype`.
fn unfused_cap(score: f32, spec: &Spec, dtype: DType) -> f32 {
    let round = |x: f32| round_to(x, dtype);
    match spec.softcap {
        None => score,
        Some(cap) => {
            let cap = cap as f32;
            round(round(round(score / cap).tanh()) * cap)
        }
    }
}

/// [`unfused_row`] over a whole call on host inputs (rows laid out `[batch, heads, seq_q]`).
pub fn unfused_attention(inputs: &Inputs, spec: impl Into<Spec>, scale: Option<f64>) -> Vec<f64> {
    unfused_attention_scores(inputs, spec, scale, &Scores::default())
}

/// [`unfused_attention`] with a mask and a bias (the bias already rounded to the dtype).
pub fn unfused_attention_scores(
    inputs: &Inputs,
    spec: impl Into<Spec>,
    scale: Option<f64>,
    extra: &Scores,
) -> Vec<f64> {
    let spec = spec.into();
    let p = &inputs.problem;
    let scale = scale.unwrap_or(1.0 / (p.head_dim as f64).sqrt());
    let (d, dv) = (p.head_dim, p.value_dim);
    let mut out = Vec::with_capacity(p.out_dims().iter().product());
    for bh in 0..p.batch * p.heads {
        let kv = p.kv_index(bh);
        let keys = &inputs.k[kv * p.seq_k * d..(kv + 1) * p.seq_k * d];
        let values = &inputs.v[kv * p.seq_k * dv..(kv + 1) * p.seq_k * dv];
        for i in 0..p.seq_q {
            let q_row = &inputs.q[(bh * p.seq_q + i) * d..(bh * p.seq_q + i + 1) * d];
            let seen = extra.seen(p, &spec, bh, i);
            out.extend(unfused_row_keys(
                q_row,
                keys,
                values,
                dv,
                &seen,
                scale,
                &spec,
                extra.bias_row(p, bh, i),
                extra.keep_row(p, bh, i),
                inputs.dtype,
            ));
        }
    }
    out
}

/// Compare log-sum-exp rows: equal infinities (rows that see no key) count as exact; a NaN, or
/// an infinity where the reference is finite (or the reverse), fails.
pub fn lse_error(got: &[f64], reference: &[f64]) -> Error {
    assert_eq!(
        got.len(),
        reference.len(),
        "result and reference differ in length"
    );
    let mut max_abs: f64 = 0.0;
    let mut ref_max: f64 = 0.0;
    let mut non_finite = 0;
    for (&g, &r) in got.iter().zip(reference) {
        if r == f64::NEG_INFINITY {
            if g != f64::NEG_INFINITY {
                non_finite += 1;
            }
            continue;
        }
        if !g.is_finite() {
            non_finite += 1;
            continue;
        }
        max_abs = max_abs.max((g - r).abs());
        ref_max = ref_max.max(r.abs());
    }
    if non_finite > 0 {
        max_abs = f64::INFINITY;
    }
    let relative = if ref_max > 0.0 {
        max_abs / ref_max
    } else {
        max_abs
    };
    Error {
        relative,
        row_relative: relative,
        max_abs,
        ref_max,
        non_finite,
    }
}

/// Indices of the output rows (flattened `[batch, heads, seq_q]`) that see no key.
pub fn masked_rows(p: &Problem, spec: impl Into<Spec>) -> Vec<usize> {
    masked_rows_scores(p, spec, &Scores::default())
}

/// [`masked_rows`] with a mask and a bias (a row whose seen keys all have a bias of `-inf`
/// sees nothing either).
pub fn masked_rows_scores(p: &Problem, spec: impl Into<Spec>, extra: &Scores) -> Vec<usize> {
    let spec = spec.into();
    (0..p.batch * p.heads * p.seq_q)
        .filter(|&row| {
            let (bh, i) = (row / p.seq_q, row % p.seq_q);
            let bias = extra.bias_row(p, bh, i);
            extra
                .seen(p, &spec, bh, i)
                .iter()
                .all(|&j| bias.is_some_and(|bias| bias[j] == f64::NEG_INFINITY))
        })
        .collect()
}

/// Reference gradients of `sum(grad_out ∘ attention(q, k, v))` with respect to `q`, `k` and `v`,
/// in f64, by the textbook formulas on the full score matrix of each head: `P = softmax(S)`,
/// `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P ∘ (dP − rowsum(dP ∘ P))`, times the softcap's
/// derivative `1 − tanh²` where there is one, `dQ = scale·dS·K`, `dK = scale·dSᵀ·Q`; key/value
/// gradients summed over the query heads that read them. Rows that see no key have zero
/// gradients.
#[allow(clippy::too_many_arguments)]
pub fn reference_grads(
    p: &Problem,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    grad_out: &[f64],
    spec: impl Into<Spec>,
    scale: Option<f64>,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (dq, dk, dv, _) =
        reference_grads_scores(p, q, k, v, grad_out, spec, scale, &Scores::default());
    (dq, dk, dv)
}

/// [`reference_grads`] with a mask and a bias; also returns the gradient of the scores
/// (`P ∘ (dP − rowsum)`, the bias's gradient before any broadcast is summed),
/// `[batch, heads, seq_q, seq_k]`.
#[allow(clippy::too_many_arguments)]
pub fn reference_grads_scores(
    p: &Problem,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    grad_out: &[f64],
    spec: impl Into<Spec>,
    scale: Option<f64>,
    extra: &Scores,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let spec = spec.into();
    let scale = scale.unwrap_or(1.0 / (p.head_dim as f64).sqrt());
    let (d, dv, sq, sk) = (p.head_dim, p.value_dim, p.seq_q, p.seq_k);
    let mut dq = vec![0.0; q.len()];
    let mut dk = vec![0.0; k.len()];
    let mut dvs = vec![0.0; v.len()];
    let mut dbias = vec![0.0; p.batch * p.heads * sq * sk];
    for bh in 0..p.batch * p.heads {
        let kv = p.kv_index(bh);
        let (qo, ko, vo, go) = (bh * sq * d, kv * sk * d, kv * sk * dv, bh * sq * dv);
        for i in 0..sq {
            let seen = extra.seen(p, &spec, bh, i);
            let bias = extra.bias_row(p, bh, i);
            let keep = extra.keep_row(p, bh, i);
            let q_row = &q[qo + i * d..qo + (i + 1) * d];
            let g_row = &grad_out[go + i * dv..go + (i + 1) * dv];
            let (scores, slopes): (Vec<f64>, Vec<f64>) = seen
                .iter()
                .map(|&j| {
                    let key = &k[ko + j * d..ko + (j + 1) * d];
                    let (capped, slope) =
                        spec.cap(scale * q_row.iter().zip(key).map(|(a, b)| a * b).sum::<f64>());
                    (capped + bias.map_or(0.0, |bias| bias[j]), slope)
                })
                .unzip();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            if max == f64::NEG_INFINITY {
                continue;
            }
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = weights.iter().sum();
            let probs: Vec<f64> = weights.iter().map(|w| w / sum).collect();
            // The factor of each seen key's probability (dropout), and dP through it.
            let factor: Vec<f64> = seen
                .iter()
                .map(|&j| keep.map_or(1.0, |keep| keep[j]))
                .collect();
            let dp: Vec<f64> = seen
                .iter()
                .zip(&factor)
                .map(|(&j, m)| {
                    let value = &v[vo + j * dv..vo + (j + 1) * dv];
                    m * g_row.iter().zip(value).map(|(a, b)| a * b).sum::<f64>()
                })
                .collect();
            let row_dot: f64 = probs.iter().zip(&dp).map(|(a, b)| a * b).sum();
            for (n, &j) in seen.iter().enumerate() {
                dbias[(bh * sq + i) * sk + j] = probs[n] * (dp[n] - row_dot);
                let ds = probs[n] * (dp[n] - row_dot) * slopes[n];
                for c in 0..d {
                    dq[qo + i * d + c] += scale * ds * k[ko + j * d + c];
                    dk[ko + j * d + c] += scale * ds * q_row[c];
                }
                for c in 0..dv {
                    dvs[vo + j * dv + c] += probs[n] * factor[n] * g_row[c];
                }
            }
        }
    }
    (dq, dk, dvs, dbias)
}

/// Gradients of the unfused attention in low precision, emulated on the CPU: the steps of Burn's
/// autodiff through `attention_fallback` (`P` as in [`unfused_row`]; `dV = Pᵀ·dO`,
/// `dP = dO·Vᵀ`, `dS = P ∘ (dP − rowsum(dP ∘ P))`, the softcap's chain rule, `dS · scale`,
/// `dQ = dS·K`, `dK = dSᵀ·Q`, key/value gradients of a group summed as the backward of an
/// expand does), each intermediate rounded to the inputs' dtype, f32 accumulation inside products
/// and sums. The baseline of the FlashAttention test rule for gradients on small shapes, where
/// running Burn's own autodiff would cost an autotune per odd length.
pub fn unfused_grads(
    inputs: &Inputs,
    grad_out: &[f32],
    spec: impl Into<Spec>,
    scale: Option<f64>,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (dq, dk, dv, _) = unfused_grads_scores(inputs, grad_out, spec, scale, &Scores::default());
    (dq, dk, dv)
}

/// [`unfused_grads`] with a mask and a bias (rounded to the dtype); also returns the rounded
/// gradient of the scores, `[batch, heads, seq_q, seq_k]`.
pub fn unfused_grads_scores(
    inputs: &Inputs,
    grad_out: &[f32],
    spec: impl Into<Spec>,
    scale: Option<f64>,
    extra: &Scores,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let spec = spec.into();
    let p = &inputs.problem;
    let dtype = inputs.dtype;
    let round = |x: f32| round_to(x, dtype);
    let scale = round(scale.unwrap_or(1.0 / (p.head_dim as f64).sqrt()) as f32);
    let (d, dv, sq, sk) = (p.head_dim, p.value_dim, p.seq_q, p.seq_k);
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |acc, (x, y)| acc + x * y);
    let mut dq = vec![0f32; inputs.q.len()];
    let mut dk = vec![0f32; inputs.k.len()];
    let mut dvs = vec![0f32; inputs.v.len()];
    let mut dbias = vec![0f32; p.batch * p.heads * sq * sk];
    for bh in 0..p.batch * p.heads {
        let kv = p.kv_index(bh);
        let (qo, ko, vo, go) = (bh * sq * d, kv * sk * d, kv * sk * dv, bh * sq * dv);
        let q = &inputs.q[qo..qo + sq * d];
        let k = &inputs.k[ko..ko + sk * d];
        let v = &inputs.v[vo..vo + sk * dv];
        let g = &grad_out[go..go + sq * dv];
        // Rounded dS · scale of the whole head, row-major [sq, sk].
        let mut ds = vec![0f32; sq * sk];
        let mut probs = vec![0f32; sq * sk];
        for i in 0..sq {
            let seen = extra.seen(p, &spec, bh, i);
            let bias = extra.bias_row(p, bh, i);
            let keep = extra.keep_row(p, bh, i);
            let q_row = &q[i * d..(i + 1) * d];
            let raw: Vec<f32> = seen
                .iter()
                .map(|&j| round(round(dot(q_row, &k[j * d..(j + 1) * d])) * scale))
                .collect();
            let scores: Vec<f32> = raw
                .iter()
                .zip(&seen)
                .map(|(&s, &j)| {
                    let capped = unfused_cap(s, &spec, dtype);
                    bias.map_or(capped, |bias| round(capped + bias[j] as f32))
                })
                .collect();
            if scores.iter().all(|&s| s == f32::NEG_INFINITY) {
                continue;
            }
            let row = rounded_softmax(&scores, dtype);
            let g_row = &g[i * dv..(i + 1) * dv];
            // Through dropout: dP of the probabilities is dP of the dropped ones times the factor.
            let factor = |j: usize| keep.map_or(1.0, |keep| keep[j] as f32);
            let dp: Vec<f32> = seen
                .iter()
                .map(|&j| round(round(dot(g_row, &v[j * dv..(j + 1) * dv])) * factor(j)))
                .collect();
            let row_dot = round(row.iter().zip(&dp).map(|(a, b)| round(a * b)).sum::<f32>());
            for (n, &j) in seen.iter().enumerate() {
                probs[i * sk + j] = round(row[n] * factor(j));
                let mut grad = round(row[n] * round(dp[n] - row_dot));
                dbias[(bh * sq + i) * sk + j] = grad;
                if let Some(cap) = spec.softcap {
                    let cap = cap as f32;
                    let t = round(round(raw[n] / cap).tanh());
                    grad = round(round(round(grad * cap) * round(1.0 - t * t)) / cap);
                }
                ds[i * sk + j] = round(grad * scale);
            }
        }
        for j in 0..sk {
            for c in 0..dv {
                let acc = (0..sq).fold(0f32, |acc, i| acc + probs[i * sk + j] * g[i * dv + c]);
                let at = vo + j * dv + c;
                dvs[at] = round(dvs[at] + round(acc));
            }
            for c in 0..d {
                let acc = (0..sq).fold(0f32, |acc, i| acc + ds[i * sk + j] * q[i * d + c]);
                let at = ko + j * d + c;
                dk[at] = round(dk[at] + round(acc));
            }
        }
        for i in 0..sq {
            for c in 0..d {
                let acc = (0..sk).fold(0f32, |acc, j| acc + ds[i * sk + j] * k[j * d + c]);
                dq[qo + i * d + c] = round(acc);
            }
        }
    }
    let widen = |x: Vec<f32>| x.into_iter().map(f64::from).collect();
    (widen(dq), widen(dk), widen(dvs), widen(dbias))
}

/// Check [`reference_grads`] against central finite differences of [`reference_attention`] on
/// the loss `Σ g ∘ attention(q, k, v)`, every input element, in f64; panics on a mismatch.
pub fn check_reference_grads_by_differences(
    problem: &Problem,
    spec: Spec,
    scale: Option<f64>,
    seed: u64,
) {
    let inputs = Inputs::random(*problem, DType::F32, seed);
    let (q, k, v) = (widen(&inputs.q), widen(&inputs.k), widen(&inputs.v));
    let g = widen(&random_normal(
        problem.out_dims().iter().product(),
        seed ^ 0xD1FF,
        DType::F32,
    ));
    let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
        let (out, _) = reference_attention(problem, q, k, v, spec, scale);
        out.iter().zip(&g).map(|(o, g)| o * g).sum()
    };
    let (dq, dk, dv) = reference_grads(problem, &q, &k, &v, &g, spec, scale);
    let h = 1e-6;
    for (which, analytic) in [(0, &dq), (1, &dk), (2, &dv)] {
        for index in 0..analytic.len() {
            let mut plus = [q.clone(), k.clone(), v.clone()];
            let mut minus = plus.clone();
            plus[which][index] += h;
            minus[which][index] -= h;
            let numeric = (loss(&plus[0], &plus[1], &plus[2])
                - loss(&minus[0], &minus[1], &minus[2]))
                / (2.0 * h);
            assert!(
                (numeric - analytic[index]).abs() <= 1e-6 * (1.0 + numeric.abs()),
                "{problem} {spec}: input {which} index {index}: numeric {numeric}, analytic {}",
                analytic[index]
            );
        }
    }
}
