//! A key/value cache for decoding: keys and values preallocated for `capacity` positions per
//! sequence, new positions written in place, and the filled part attended by the fused kernel as
//! a view (no copy of the cache per call).

use burn::tensor::{DType, Device, Int, Tensor, TensorData, s};

use crate::api::try_flash_attention;
use crate::error::FlashAttentionError;
use crate::lengths::try_flash_attention_with_lengths;
use crate::options::FlashAttentionOptions;

/// Keys `[batch, kv_heads, capacity, head_dim]` and values `[batch, kv_heads, capacity,
/// value_dim]` of `batch` sequences, each filled up to its own length, for decoding one or a
/// few positions at a time (FlashAttention-2's `flash_attn_with_kvcache`).
///
/// [`append`](Self::append) writes the newest keys and values of every sequence after its
/// filled part; [`attend`](Self::attend) runs the queries of those newest positions over the
/// filled part, causal per sequence where the options are causal. Where every sequence has the
/// same length the filled part is passed to [`flash_attention`](crate::flash_attention) as a
/// view (grouped query heads packed into one block's rows and the keys split across cubes where
/// the plan chooses); with lengths that differ, through
/// [`try_flash_attention_with_lengths`](crate::try_flash_attention_with_lengths), whose fused
/// forward stops at each sequence's length, with the same fast paths.
///
/// # Example
///
/// ```no_run
/// use burn::tensor::{DType, Device, Distribution, Tensor};
/// use burn_flash::{FlashAttentionOptions, KvCache};
///
/// let device = Device::wgpu(Default::default());
/// let [batch, heads, kv_heads, dim] = [2, 8, 2, 64];
/// let mut cache = KvCache::new([batch, kv_heads, 1024, dim], dim, DType::F32, &device);
/// let random = |heads| {
///     Tensor::<4>::random([batch, heads, 1, dim], Distribution::Normal(0.0, 1.0), &device)
/// };
/// for _step in 0..3 {
///     // One new position per sequence: its key and value, then its query.
///     cache.append(random(kv_heads), random(kv_heads)).unwrap();
///     let out = cache.attend(random(heads), FlashAttentionOptions::causal()).unwrap();
///     assert_eq!(out.dims(), [batch, heads, 1, dim]);
/// }
/// assert_eq!(cache.lengths(), &[3, 3]);
/// ```
#[derive(Debug)]
pub struct KvCache {
    buffers: Buffers,
    lengths: Vec<usize>,
}

impl KvCache {
    /// An empty cache of `[batch, kv_heads, capacity, head_dim]` keys and values of
    /// `value_dim`, zeros of `dtype` on `device`.
    pub fn new(
        [batch, kv_heads, capacity, head_dim]: [usize; 4],
        value_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Self {
        let zeros = |dim| Tensor::zeros([batch, kv_heads, capacity, dim], (device, dtype));
        Self {
            buffers: Buffers::new(zeros(head_dim), zeros(value_dim)),
            lengths: vec![0; batch],
        }
    }

    /// The filled length of each sequence.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use burn::tensor::{DType, Device};
    /// use burn_flash::KvCache;
    ///
    /// let device = Device::wgpu(Default::default());
    /// let cache = KvCache::new([4, 2, 256, 64], 64, DType::F32, &device);
    /// assert_eq!(cache.lengths(), &[0, 0, 0, 0]);
    /// ```
    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    /// Positions each sequence can hold.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use burn::tensor::{DType, Device};
    /// use burn_flash::KvCache;
    ///
    /// let device = Device::wgpu(Default::default());
    /// let cache = KvCache::new([1, 2, 256, 64], 64, DType::F32, &device);
    /// assert_eq!(cache.capacity(), 256);
    /// ```
    pub fn capacity(&self) -> usize {
        self.buffers.keys().dims()[2]
    }

    /// Forget every sequence's positions (the buffers are kept).
    ///
    /// # Example
    ///
    /// ```no_run
    /// # use burn::tensor::{DType, Device, Tensor};
    /// # use burn_flash::KvCache;
    /// # let device = Device::wgpu(Default::default());
    /// let mut cache = KvCache::new([1, 1, 16, 8], 8, DType::F32, &device);
    /// let new = || Tensor::<4>::zeros([1, 1, 2, 8], &device);
    /// cache.append(new(), new()).unwrap();
    /// cache.clear();
    /// assert_eq!(cache.lengths(), &[0]);
    /// ```
    pub fn clear(&mut self) {
        self.lengths.fill(0);
    }

    /// Forget sequence `seq`'s positions, so that its slot takes a new sequence with the next
    /// append (continuous batching); the other sequences keep theirs.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # use burn::tensor::{DType, Device, Tensor};
    /// # use burn_flash::KvCache;
    /// # let device = Device::wgpu(Default::default());
    /// let mut cache = KvCache::new([2, 1, 16, 8], 8, DType::F32, &device);
    /// let new = || Tensor::<4>::zeros([2, 1, 3, 8], &device);
    /// cache.append(new(), new()).unwrap();
    /// cache.release(0);
    /// assert_eq!(cache.lengths(), &[0, 3]);
    /// ```
    pub fn release(&mut self, seq: usize) {
        self.lengths[seq] = 0;
    }

    /// Write `keys: [batch, kv_heads, n, head_dim]` and `values: [batch, kv_heads, n,
    /// value_dim]` at the positions after each sequence's filled part, which grows by `n`.
    /// Refused (nothing written) where the shapes, dtype or device differ from the cache's, or
    /// a sequence would outgrow the capacity.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use burn::tensor::{DType, Device, Tensor};
    /// use burn_flash::{FlashAttentionError, KvCache};
    ///
    /// let device = Device::wgpu(Default::default());
    /// let mut cache = KvCache::new([1, 2, 4, 16], 16, DType::F32, &device);
    /// let new = || Tensor::<4>::zeros([1, 2, 3, 16], &device);
    /// cache.append(new(), new()).unwrap();
    /// assert!(matches!(cache.append(new(), new()), Err(FlashAttentionError::CacheFull { .. })));
    /// ```
    pub fn append(
        &mut self,
        keys: Tensor<4>,
        values: Tensor<4>,
    ) -> Result<(), FlashAttentionError> {
        let counts = vec![keys.dims()[2]; self.lengths.len()];
        self.append_each(keys, values, &counts)
    }

    /// [`append`](Self::append) of the first `counts[s]` of the `n` new positions of each
    /// sequence `s` (prompts of different lengths, padded to `n` at their end): its filled part
    /// grows by `counts[s]`, the rest of the block is ignored.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use burn::tensor::{DType, Device, Tensor};
    /// use burn_flash::KvCache;
    ///
    /// let device = Device::wgpu(Default::default());
    /// let mut cache = KvCache::new([3, 2, 64, 16], 16, DType::F32, &device);
    /// let prompts = || Tensor::<4>::zeros([3, 2, 10, 16], &device);
    /// cache.append_each(prompts(), prompts(), &[10, 4, 7]).unwrap();
    /// assert_eq!(cache.lengths(), &[10, 4, 7]);
    /// ```
    pub fn append_each(
        &mut self,
        keys: Tensor<4>,
        values: Tensor<4>,
        counts: &[usize],
    ) -> Result<(), FlashAttentionError> {
        let cache = self.buffers.keys().dims();
        let value_dim = self.buffers.values().dims()[3];
        let n = keys.dims()[2];
        check_new(
            "keys",
            self.buffers.keys(),
            &keys,
            [cache[0], cache[1], n, cache[3]],
        )?;
        check_new(
            "values",
            self.buffers.values(),
            &values,
            [cache[0], cache[1], n, value_dim],
        )?;
        check_counts(counts, cache[0], n)?;
        let needed = (self.lengths.iter().zip(counts))
            .map(|(len, count)| len + count)
            .max()
            .unwrap_or(0);
        if needed > cache[2] {
            return Err(FlashAttentionError::CacheFull {
                capacity: cache[2],
                needed,
            });
        }
        let (mut all_keys, mut all_values) = self.buffers.take();
        let start = self.lengths.first().copied().unwrap_or(0);
        if self.lengths.iter().all(|&len| len == start) && counts.iter().all(|&c| c == n) {
            all_keys = all_keys.slice_assign(s![.., .., start..start + n], keys);
            all_values = all_values.slice_assign(s![.., .., start..start + n], values);
        } else {
            for (seq, (&len, &count)) in self.lengths.iter().zip(counts).enumerate() {
                if count == 0 {
                    continue;
                }
                let at = s![seq..seq + 1, .., len..len + count];
                let new = s![seq..seq + 1, .., 0..count];
                all_keys = all_keys.slice_assign(at, keys.clone().slice(new));
                all_values = all_values.slice_assign(at, values.clone().slice(new));
            }
        }
        self.buffers.put(all_keys, all_values);
        for (len, count) in self.lengths.iter_mut().zip(counts) {
            *len += count;
        }
        Ok(())
    }

    /// Attention of `q: [batch, heads, n, head_dim]`, the queries of each sequence's last `n`
    /// positions, over its filled part: `[batch, heads, n, value_dim]`. `heads` is a multiple
    /// of the cache's key/value heads (grouped-query attention). With `options.causal` the query
    /// at position `p` of a sequence sees its keys up to `p` (bottom-right, per sequence);
    /// without, every key of its sequence. The other options apply as in
    /// [`flash_attention`](crate::flash_attention), each on its sequence's own diagonal; where
    /// the lengths differ and a gradient is needed (or the fused kernel cannot run the inputs),
    /// ALiBi is refused ([`try_flash_attention_with_lengths`](crate::try_flash_attention_with_lengths)).
    ///
    /// # Example
    ///
    /// ```no_run
    /// use burn::tensor::{DType, Device, Distribution, Tensor};
    /// use burn_flash::{FlashAttentionOptions, KvCache};
    ///
    /// let device = Device::wgpu(Default::default());
    /// let random = |dims| Tensor::<4>::random(dims, Distribution::Normal(0.0, 1.0), &device);
    /// let mut cache = KvCache::new([1, 4, 512, 64], 64, DType::F32, &device);
    /// // A prompt of 20 positions, then its queries, causal.
    /// cache.append(random([1, 4, 20, 64]), random([1, 4, 20, 64])).unwrap();
    /// let out = cache.attend(random([1, 8, 20, 64]), FlashAttentionOptions::causal()).unwrap();
    /// assert_eq!(out.dims(), [1, 8, 20, 64]);
    /// ```
    pub fn attend(
        &self,
        q: Tensor<4>,
        options: FlashAttentionOptions,
    ) -> Result<Tensor<4>, FlashAttentionError> {
        let longest = self.lengths.iter().max().copied().unwrap_or(0);
        let filled = |t: &Tensor<4>| t.clone().slice(s![.., .., 0..longest]);
        let (keys, values) = (filled(self.buffers.keys()), filled(self.buffers.values()));
        if self.lengths.iter().all(|&len| len == longest) {
            return try_flash_attention(q, keys, values, options);
        }
        let lengths: Vec<u32> = self.lengths.iter().map(|&len| len as u32).collect();
        let lengths = Tensor::<1, Int>::from_data(
            TensorData::new(lengths, [self.lengths.len()]),
            &q.device(),
        );
        try_flash_attention_with_lengths(q, keys, values, lengths, options)
    }

    /// [`append`](Self::append) the newest positions' keys and values, then
    /// [`attend`](Self::attend) their queries.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use burn::tensor::{DType, Device, Distribution, Tensor};
    /// use burn_flash::{FlashAttentionOptions, KvCache};
    ///
    /// let device = Device::wgpu(Default::default());
    /// let normal = Distribution::Normal(0.0, 1.0);
    /// let random = |heads| Tensor::<4>::random([1, heads, 1, 32], normal, &device);
    /// let mut cache = KvCache::new([1, 2, 64, 32], 32, DType::F32, &device);
    /// let out = cache
    ///     .append_and_attend(random(4), random(2), random(2), FlashAttentionOptions::causal())
    ///     .unwrap();
    /// assert_eq!(out.dims(), [1, 4, 1, 32]);
    /// ```
    pub fn append_and_attend(
        &mut self,
        q: Tensor<4>,
        keys: Tensor<4>,
        values: Tensor<4>,
        options: FlashAttentionOptions,
    ) -> Result<Tensor<4>, FlashAttentionError> {
        self.append(keys, values)?;
        self.attend(q, options)
    }
}

/// A cache's keys and values, taken out while an append writes into them, so that the write
/// can reuse their buffers.
#[derive(Debug)]
pub(crate) struct Buffers {
    keys: Option<Tensor<4>>,
    values: Option<Tensor<4>>,
}

impl Buffers {
    pub(crate) fn new(keys: Tensor<4>, values: Tensor<4>) -> Self {
        Self {
            keys: Some(keys),
            values: Some(values),
        }
    }

    pub(crate) fn keys(&self) -> &Tensor<4> {
        self.keys
            .as_ref()
            .expect("the keys are back after every append")
    }

    pub(crate) fn values(&self) -> &Tensor<4> {
        self.values
            .as_ref()
            .expect("the values are back after every append")
    }

    /// The buffers, owned, so that writing into them need not copy them; [`put`](Self::put)
    /// gives them back.
    pub(crate) fn take(&mut self) -> (Tensor<4>, Tensor<4>) {
        let taken = (self.keys.take(), self.values.take());
        (
            taken.0.expect("the keys are back after every append"),
            taken.1.expect("the values are back after every append"),
        )
    }

    pub(crate) fn put(&mut self, keys: Tensor<4>, values: Tensor<4>) {
        (self.keys, self.values) = (Some(keys), Some(values));
    }
}

/// Check the counts of an `append_each`: one per sequence of `batch`, none past the `n` new
/// positions.
pub(crate) fn check_counts(
    counts: &[usize],
    batch: usize,
    n: usize,
) -> Result<(), FlashAttentionError> {
    if counts.len() != batch || counts.iter().any(|&count| count > n) {
        return Err(FlashAttentionError::CacheOptions(format!(
            "counts {counts:?} of new positions to blocks of {n} for {batch} sequences"
        )));
    }
    Ok(())
}

/// Check a new block of keys or values against the cache it goes into.
pub(crate) fn check_new(
    input: &'static str,
    cache: &Tensor<4>,
    new: &Tensor<4>,
    expected: [usize; 4],
) -> Result<(), FlashAttentionError> {
    if new.dims() != expected {
        return Err(FlashAttentionError::CacheShape {
            input,
            expected: expected.to_vec(),
            got: new.dims().to_vec(),
        });
    }
    if new.dtype() != cache.dtype() || new.device() != cache.device() {
        return Err(FlashAttentionError::CacheInput {
            input,
            expected: format!("{:?} on {:?}", cache.dtype(), cache.device()),
            got: format!("{:?} on {:?}", new.dtype(), new.device()),
        });
    }
    Ok(())
}
