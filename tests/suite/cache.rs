//! `KvCache` and `PagedKvCache`: prompts of equal and of different lengths, decoding steps of
//! one and of several positions, grouped query heads, sequences released and their slots
//! reused, against the f64 reference of the keys and values each sequence holds (a host copy of
//! everything appended), on wgpu (f32, the portable tile) and, with feature `cuda`, on the
//! tensor-core tile in bf16. The outputs are poisoned with NaN before the kernels run.

use crate::common;

use burn::tensor::{DType, Device, Tensor};
use burn_flash::{FlashAttentionError, FlashAttentionOptions, KvCache, PagedKvCache};
use common::{Error, error, random_normal, reference_row, tensor_from_host, to_host, widen};

/// One step of a decoding run.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// `n` new positions per sequence, of which sequence `s` keeps the first `counts(n)[s]`
    /// (`None`: all `n`).
    Append(usize, Option<&'static [usize]>),
    /// Queries of each sequence's last `n` positions, causal or not.
    Attend(usize, bool),
    /// Sequence `s` forgotten: its slot starts a new sequence.
    Release(usize),
}

/// What the runs do with a cache: both kinds alike.
trait Cache {
    fn append_each(
        &mut self,
        keys: Tensor<4>,
        values: Tensor<4>,
        counts: &[usize],
    ) -> Result<(), FlashAttentionError>;
    fn attend(
        &self,
        q: Tensor<4>,
        options: FlashAttentionOptions,
    ) -> Result<Tensor<4>, FlashAttentionError>;
    fn lengths(&self) -> &[usize];
    fn release(&mut self, seq: usize);
}

macro_rules! cache {
    ($cache:ty) => {
        impl Cache for $cache {
            fn append_each(
                &mut self,
                keys: Tensor<4>,
                values: Tensor<4>,
                counts: &[usize],
            ) -> Result<(), FlashAttentionError> {
                <$cache>::append_each(self, keys, values, counts)
            }
            fn attend(
                &self,
                q: Tensor<4>,
                options: FlashAttentionOptions,
            ) -> Result<Tensor<4>, FlashAttentionError> {
                <$cache>::attend(self, q, options)
            }
            fn lengths(&self) -> &[usize] {
                <$cache>::lengths(self)
            }
            fn release(&mut self, seq: usize) {
                <$cache>::release(self, seq)
            }
        }
    };
}
cache!(KvCache);
cache!(PagedKvCache);

/// Which cache a run fills: contiguous, or in pages of this many positions (the pool holds the
/// capacity of every sequence in pages, and two pages more).
#[derive(Clone, Copy, Debug)]
enum Layout {
    Contiguous,
    Paged(usize),
}

/// The cache's shape and the query heads.
#[derive(Clone, Copy, Debug)]
struct CacheShape {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    capacity: usize,
    head_dim: usize,
    value_dim: usize,
}

/// Run `steps` on a fresh cache of `shape` and `layout` on `device` in `dtype`; every
/// attention is judged by `accept` against the reference. Returns the failures.
fn run(
    device: &Device,
    dtype: DType,
    shape: CacheShape,
    layout: Layout,
    steps: &[Step],
    seed: u64,
    accept: impl Fn(&Error) -> bool,
) -> Vec<String> {
    burn_flash::testing::poison_outputs(true);
    let CacheShape {
        batch,
        heads,
        kv_heads,
        capacity,
        head_dim,
        value_dim,
    } = shape;
    let mut cache: Box<dyn Cache> = match layout {
        Layout::Contiguous => Box::new(KvCache::new(
            [batch, kv_heads, capacity, head_dim],
            value_dim,
            dtype,
            device,
        )),
        Layout::Paged(page) => Box::new(
            PagedKvCache::new(
                batch * capacity.div_ceil(page) + 2,
                page,
                batch,
                [kv_heads, head_dim],
                value_dim,
                dtype,
                device,
            )
            .expect("pages of a multiple of 64"),
        ),
    };
    // Host copies of each (sequence, key/value head)'s rows, as appended.
    let mut keys = vec![Vec::<f32>::new(); batch * kv_heads];
    let mut values = vec![Vec::<f32>::new(); batch * kv_heads];
    let mut failures = Vec::new();
    for (index, &step) in steps.iter().enumerate() {
        let seed = seed * 1000 + index as u64;
        match step {
            Step::Append(n, counts) => {
                let counts = counts.map_or(vec![n; batch], <[usize]>::to_vec);
                let new_k = random_normal(batch * kv_heads * n * head_dim, seed, dtype);
                let new_v = random_normal(batch * kv_heads * n * value_dim, seed ^ 7, dtype);
                let dims = |dim| [batch, kv_heads, n, dim];
                cache
                    .append_each(
                        tensor_from_host(&new_k, dims(head_dim), dtype, device),
                        tensor_from_host(&new_v, dims(value_dim), dtype, device),
                        &counts,
                    )
                    .expect("the append fits the cache");
                for (bh, (k_rows, v_rows)) in keys.iter_mut().zip(&mut values).enumerate() {
                    let count = counts[bh / kv_heads];
                    k_rows.extend_from_slice(&new_k[bh * n * head_dim..][..count * head_dim]);
                    v_rows.extend_from_slice(&new_v[bh * n * value_dim..][..count * value_dim]);
                }
            }
            Step::Release(seq) => {
                cache.release(seq);
                for h in 0..kv_heads {
                    keys[seq * kv_heads + h].clear();
                    values[seq * kv_heads + h].clear();
                }
            }
            Step::Attend(n, causal) => {
                let q = random_normal(batch * heads * n * head_dim, seed ^ 11, dtype);
                let q_tensor = tensor_from_host(&q, [batch, heads, n, head_dim], dtype, device);
                let options = FlashAttentionOptions::new().with_causal(causal);
                let got = to_host(cache.attend(q_tensor, options).expect("attention runs"));
                let q = widen(&q);
                let scale = 1.0 / (head_dim as f64).sqrt();
                let mut reference = Vec::with_capacity(got.len());
                for b in 0..batch {
                    let len = cache.lengths()[b];
                    for h in 0..heads {
                        let kv = b * kv_heads + h / (heads / kv_heads);
                        let (k_rows, v_rows) = (widen(&keys[kv]), widen(&values[kv]));
                        for i in 0..n {
                            // Query i is the sequence's position len - n + i.
                            let visible = match causal {
                                true => (len + i + 1).saturating_sub(n),
                                false => len,
                            };
                            let row = &q[((b * heads + h) * n + i) * head_dim..][..head_dim];
                            let (out, _) =
                                reference_row(row, &k_rows, &v_rows, value_dim, visible, scale);
                            reference.extend(out);
                        }
                    }
                }
                let err = error(&got, &reference, value_dim);
                let label = format!(
                    "{dtype:?} {shape:?} {layout:?} step {index} {step:?} lengths {:?}",
                    cache.lengths()
                );
                eprintln!("{label}: {err}");
                if !accept(&err) {
                    failures.push(format!("{label}: {err}"));
                }
            }
        }
    }
    failures
}

/// A prompt, then decoding one position at a time, then two at a time (speculative
/// verification), causal; equal lengths take the fused kernel on the cache's filled part as a
/// view.
const EQUAL: &[Step] = &[
    Step::Append(20, None),
    Step::Attend(20, true),
    Step::Append(1, None),
    Step::Attend(1, true),
    Step::Append(1, None),
    Step::Attend(1, false),
    Step::Append(2, None),
    Step::Attend(2, true),
];

/// Prompts of 12, 5 and 0 positions (padded to 12), then decoding: lengths that differ take the
/// fused forward that stops at each sequence's length; the empty sequence's first query sees
/// only its own position.
const RAGGED: &[Step] = &[
    Step::Append(12, Some(&[12, 5, 0])),
    Step::Append(1, None),
    Step::Attend(1, true),
    Step::Append(2, None),
    Step::Attend(2, true),
    Step::Attend(3, false),
    Step::Append(3, Some(&[0, 3, 1])),
    Step::Attend(1, true),
];

/// Sequences longer than a page of 64, then two released mid-run and their slots refilled
/// (in a paged cache, with pages given back and taken again out of order).
const RELEASED: &[Step] = &[
    Step::Append(70, Some(&[70, 9, 66])),
    Step::Attend(1, true),
    Step::Release(0),
    Step::Append(1, None),
    Step::Attend(1, true),
    Step::Release(2),
    Step::Append(30, Some(&[30, 0, 2])),
    Step::Attend(2, true),
    Step::Attend(1, false),
];

mod wgpu {
    use super::*;

    /// Tolerance of the f32 results, as in `forward_wgpu`.
    const TOLERANCE: f64 = 1e-4;

    fn accept(err: &Error) -> bool {
        err.finite() && err.relative <= TOLERANCE && err.max_abs <= TOLERANCE * err.ref_max.max(1.0)
    }

    #[test]
    fn decoding_matches_the_reference() {
        let device = Device::wgpu(Default::default());
        let mut failures = Vec::new();
        let grouped = CacheShape {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            capacity: 48,
            head_dim: 32,
            value_dim: 32,
        };
        let ragged = CacheShape {
            batch: 3,
            heads: 2,
            kv_heads: 1,
            capacity: 40,
            head_dim: 64,
            value_dim: 16,
        };
        let released = CacheShape {
            capacity: 110,
            ..ragged
        };
        for layout in [Layout::Contiguous, Layout::Paged(64)] {
            let run =
                |shape, steps, seed| run(&device, DType::F32, shape, layout, steps, seed, accept);
            failures.extend(run(grouped, EQUAL, 1));
            failures.extend(run(ragged, RAGGED, 2));
            failures.extend(run(released, RELEASED, 3));
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// Appends that do not fit are refused and leave the cache as it was; a paged cache
    /// refuses pages of other than a multiple of 64 positions and appends past its free
    /// pages.
    #[test]
    fn bad_appends_and_options_are_refused() {
        let device = Device::wgpu(Default::default());
        let mut cache = KvCache::new([2, 2, 8, 16], 8, DType::F32, &device);
        let new = |n, dim| Tensor::<4>::zeros([2, 2, n, dim], &device);
        assert!(matches!(
            cache.append(new(3, 8), new(3, 8)),
            Err(FlashAttentionError::CacheShape { input: "keys", .. })
        ));
        assert!(matches!(
            cache.append(new(3, 16), new(2, 8)),
            Err(FlashAttentionError::CacheShape {
                input: "values",
                ..
            })
        ));
        cache.append_each(new(6, 16), new(6, 8), &[6, 2]).unwrap();
        assert!(matches!(
            cache.append(new(3, 16), new(3, 8)),
            Err(FlashAttentionError::CacheFull {
                capacity: 8,
                needed: 9
            })
        ));
        assert!(matches!(
            cache.append_each(new(1, 16), new(1, 8), &[2, 0]),
            Err(FlashAttentionError::CacheOptions(_))
        ));
        assert_eq!(cache.lengths(), &[6, 2]);
        // A window over lengths that differ is placed on each sequence's own diagonal
        // (`lengths` tests it against the reference).
        let q = Tensor::<4>::zeros([2, 2, 1, 16], &device);
        let window = FlashAttentionOptions::causal()
            .with_window(burn_flash::AttentionWindow::new(Some(2), None));
        assert_eq!(cache.attend(q, window).unwrap().dims(), [2, 2, 1, 8]);
        assert!(matches!(
            PagedKvCache::new(4, 96, 2, [2, 16], 8, DType::F32, &device),
            Err(FlashAttentionError::PageSize(96))
        ));
        let mut paged = PagedKvCache::new(3, 64, 2, [2, 16], 8, DType::F32, &device).unwrap();
        paged
            .append_each(new(70, 16), new(70, 8), &[70, 10])
            .unwrap();
        assert!(matches!(
            paged.append(new(60, 16), new(60, 8)),
            Err(FlashAttentionError::PagesExhausted { free: 0, needed: 2 })
        ));
        assert_eq!((paged.lengths(), paged.free_pages()), (&[70, 10][..], 0));
    }

    /// The filled part of a cache of equal lengths reaches the kernel as a view, read in
    /// place: no copy of the cache per decoding step.
    #[test]
    fn equal_lengths_read_the_cache_in_place() {
        let device = Device::wgpu(Default::default());
        let mut cache = KvCache::new([1, 2, 32, 16], 16, DType::F32, &device);
        let new = |n| Tensor::<4>::ones([1, 2, n, 16], &device);
        cache.append(new(5), new(5)).unwrap();
        let views = burn_flash::testing::views_read_in_place();
        let q = Tensor::<4>::ones([1, 2, 1, 16], &device);
        let out = cache.attend(q, FlashAttentionOptions::causal()).unwrap();
        // Every value is 1, so is their average; reading it runs the (lazy) launch.
        assert_eq!(to_host(out), vec![1.0; 32]);
        assert_eq!(burn_flash::testing::views_read_in_place(), views + 2);
    }
}

/// A cache of 4100 positions (split across cubes by the plan on a GPU), then decoding one and
/// two positions at a time.
#[cfg(feature = "cuda")]
const LONG: &[Step] = &[
    Step::Append(4100, None),
    Step::Append(1, None),
    Step::Attend(1, true),
    Step::Append(2, None),
    Step::Attend(2, true),
];

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use common::cuda::cuda_device;
    use common::unit_roundoff;

    /// bf16 on the tensor-core tile, 32 query heads over 8 key/value heads at head dim 128 (the
    /// decoding shapes): grouped heads packed into rows and keys split where the plan chooses,
    /// the cache read in place by tensor maps on SM90. The sanity bound of `forward_cuda`.
    #[test]
    fn decoding_matches_the_reference_cuda() {
        let Some(device) = cuda_device("decoding_matches_the_reference_cuda") else {
            return;
        };
        let accept = |err: &Error| {
            let u = unit_roundoff(DType::BF16);
            err.finite() && err.relative <= 4.0 * u && err.max_abs <= 8.0 * u * err.ref_max
        };
        let shape = |batch, capacity| CacheShape {
            batch,
            heads: 32,
            kv_heads: 8,
            capacity,
            head_dim: 128,
            value_dim: 128,
        };
        let mut failures = Vec::new();
        for layout in [Layout::Contiguous, Layout::Paged(256)] {
            let run =
                |shape, steps, seed| run(&device, DType::BF16, shape, layout, steps, seed, accept);
            failures.extend(run(shape(2, 4200), LONG, 3));
            failures.extend(run(shape(2, 64), EQUAL, 5));
            failures.extend(run(shape(3, 300), RAGGED, 4));
            failures.extend(run(shape(3, 300), RELEASED, 6));
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}
