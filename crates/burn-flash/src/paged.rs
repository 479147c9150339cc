//! A paged key/value cache: one pool of fixed-size pages shared by every sequence, each
//! sequence's keys in the pages its block table lists, taken from the pool as it grows and
//! given back when it is released (vLLM's PagedAttention layout). The fused forward finds each
//! key block through the table and reads it in place.

use burn::tensor::{DType, Device, IndexingUpdateOp, Int, Tensor, TensorData};

use crate::cache::{Buffers, check_counts, check_new};
use crate::error::FlashAttentionError;
use crate::lengths::try_flash_attention_paged;
use crate::options::FlashAttentionOptions;

/// Keys `[pages, page_size, kv_heads, head_dim]` and values `[pages, page_size, kv_heads,
/// value_dim]` shared by `batch` sequence slots, each holding its positions in the pages its
/// block table lists (FlashAttention-2's `flash_attn_with_kvcache` with a `block_table`).
///
/// [`append`](Self::append) writes the newest keys and values of every sequence after its
/// filled part, taking pages from the free pool as a sequence crosses into a new one (one
/// scatter of all the new rows, in place); [`attend`](Self::attend) runs the queries of the
/// newest positions over each sequence's filled part through
/// [`try_flash_attention_paged`](crate::try_flash_attention_paged);
/// [`release`](Self::release) empties a slot and returns its pages to the pool, so that a new
/// sequence can take the slot (continuous batching). Pages hold a multiple of 64 positions.
///
/// # Example
///
/// ```no_run
/// use burn::tensor::{DType, Device, Distribution, Tensor};
/// use burn_flash::{FlashAttentionOptions, PagedKvCache};
///
/// let device = Device::wgpu(Default::default());
/// let [batch, heads, kv_heads, dim] = [2, 8, 2, 64];
/// // 16 pages of 64 positions shared by two sequences.
/// let mut cache = PagedKvCache::new(16, 64, 2, [kv_heads, dim], dim, DType::F32, &device).unwrap();
/// let random = |heads, n| {
///     Tensor::<4>::random([batch, heads, n, dim], Distribution::Normal(0.0, 1.0), &device)
/// };
/// cache.append(random(kv_heads, 100), random(kv_heads, 100)).unwrap();
/// let out = cache.attend(random(heads, 1), FlashAttentionOptions::causal()).unwrap();
/// assert_eq!(out.dims(), [batch, heads, 1, dim]);
/// assert_eq!(cache.free_pages(), 12);
/// cache.release(0);
/// assert_eq!((cache.lengths(), cache.free_pages()), (&[0, 100][..], 14));
/// ```
#[derive(Debug)]
pub struct PagedKvCache {
    /// The pools of pages.
    buffers: Buffers,
    page_size: usize,
    /// Pages no sequence holds, taken from the end.
    free: Vec<u32>,
    /// The pages of each sequence, in order.
    tables: Vec<Vec<u32>>,
    lengths: Vec<usize>,
}

impl PagedKvCache {
    /// An empty cache of `pages` pages of `page_size` positions (a positive multiple of 64) for
    /// `batch` sequences, keys `[kv_heads, head_dim]` and values `value_dim` wide a position,
    /// zeros of `dtype` on `device`.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use burn::tensor::{DType, Device};
    /// use burn_flash::{FlashAttentionError, PagedKvCache};
    ///
    /// let device = Device::wgpu(Default::default());
    /// let cache = PagedKvCache::new(8, 128, 4, [2, 64], 64, DType::F32, &device).unwrap();
    /// assert_eq!((cache.page_size(), cache.free_pages()), (128, 8));
    /// assert!(matches!(
    ///     PagedKvCache::new(8, 100, 4, [2, 64], 64, DType::F32, &device),
    ///     Err(FlashAttentionError::PageSize(100))
    /// ));
    /// ```
    pub fn new(
        pages: usize,
        page_size: usize,
        batch: usize,
        [kv_heads, head_dim]: [usize; 2],
        value_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, FlashAttentionError> {
        if page_size == 0 || !page_size.is_multiple_of(64) {
            return Err(FlashAttentionError::PageSize(page_size));
        }
        let zeros = |dim| Tensor::zeros([pages, page_size, kv_heads, dim], (device, dtype));
        Ok(Self {
            buffers: Buffers::new(zeros(head_dim), zeros(value_dim)),
            page_size,
            // Popped from the end: page 0 first.
            free: (0..pages as u32).rev().collect(),
            tables: vec![Vec::new(); batch],
            lengths: vec![0; batch],
        })
    }

    /// The filled length of each sequence.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # use burn::tensor::{DType, Device};
    /// # use burn_flash::PagedKvCache;
    /// # let device = Device::wgpu(Default::default());
    /// let cache = PagedKvCache::new(4, 64, 3, [1, 32], 32, DType::F32, &device).unwrap();
    /// assert_eq!(cache.lengths(), &[0, 0, 0]);
    /// ```
    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    /// Positions a page holds.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # use burn::tensor::{DType, Device};
    /// # use burn_flash::PagedKvCache;
    /// # let device = Device::wgpu(Default::default());
    /// let cache = PagedKvCache::new(4, 256, 1, [1, 32], 32, DType::F32, &device).unwrap();
    /// assert_eq!(cache.page_size(), 256);
    /// ```
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Pages no sequence holds.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # use burn::tensor::{DType, Device, Tensor};
    /// # use burn_flash::PagedKvCache;
    /// # let device = Device::wgpu(Default::default());
    /// let mut cache = PagedKvCache::new(4, 64, 1, [1, 32], 32, DType::F32, &device).unwrap();
    /// let new = || Tensor::<4>::zeros([1, 1, 65, 32], &device);
    /// cache.append(new(), new()).unwrap();
    /// assert_eq!(cache.free_pages(), 2);
    /// ```
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// The pages sequence `seq` holds, in order: its block table's row.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # use burn::tensor::{DType, Device, Tensor};
    /// # use burn_flash::PagedKvCache;
    /// # let device = Device::wgpu(Default::default());
    /// let mut cache = PagedKvCache::new(4, 64, 1, [1, 32], 32, DType::F32, &device).unwrap();
    /// let new = || Tensor::<4>::zeros([1, 1, 65, 32], &device);
    /// cache.append(new(), new()).unwrap();
    /// assert_eq!(cache.pages(0), &[0, 1]);
    /// ```
    pub fn pages(&self, seq: usize) -> &[u32] {
        &self.tables[seq]
    }

    /// Empty sequence `seq` and give its pages back to the pool (the slot takes a new sequence
    /// with the next append).
    ///
    /// # Example
    ///
    /// ```no_run
    /// # use burn::tensor::{DType, Device, Tensor};
    /// # use burn_flash::PagedKvCache;
    /// # let device = Device::wgpu(Default::default());
    /// let mut cache = PagedKvCache::new(4, 64, 2, [1, 32], 32, DType::F32, &device).unwrap();
    /// let new = || Tensor::<4>::zeros([2, 1, 10, 32], &device);
    /// cache.append(new(), new()).unwrap();
    /// cache.release(1);
    /// assert_eq!((cache.lengths(), cache.free_pages()), (&[10, 0][..], 3));
    /// ```
    pub fn release(&mut self, seq: usize) {
        self.free.extend(self.tables[seq].drain(..).rev());
        self.lengths[seq] = 0;
    }

    /// Write `keys: [batch, kv_heads, n, head_dim]` and `values: [batch, kv_heads, n,
    /// value_dim]` at the positions after each sequence's filled part, which grows by `n`.
    /// Refused (nothing written) where the shapes, dtype or device differ from the cache's, or
    /// the free pages are too few.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use burn::tensor::{DType, Device, Tensor};
    /// use burn_flash::{FlashAttentionError, PagedKvCache};
    ///
    /// let device = Device::wgpu(Default::default());
    /// let mut cache = PagedKvCache::new(2, 64, 1, [2, 16], 16, DType::F32, &device).unwrap();
    /// let new = |n| Tensor::<4>::zeros([1, 2, n, 16], &device);
    /// cache.append(new(100), new(100)).unwrap();
    /// assert!(matches!(
    ///     cache.append(new(40), new(40)),
    ///     Err(FlashAttentionError::PagesExhausted { free: 0, needed: 1 })
    /// ));
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
    /// sequence `s` (prompts of different lengths, padded to `n` at their end).
    ///
    /// # Example
    ///
    /// ```no_run
    /// use burn::tensor::{DType, Device, Tensor};
    /// use burn_flash::PagedKvCache;
    ///
    /// let device = Device::wgpu(Default::default());
    /// let mut cache = PagedKvCache::new(8, 64, 3, [2, 16], 16, DType::F32, &device).unwrap();
    /// let prompts = || Tensor::<4>::zeros([3, 2, 70, 16], &device);
    /// cache.append_each(prompts(), prompts(), &[70, 4, 0]).unwrap();
    /// assert_eq!((cache.lengths(), cache.free_pages()), (&[70, 4, 0][..], 5));
    /// ```
    pub fn append_each(
        &mut self,
        keys: Tensor<4>,
        values: Tensor<4>,
        counts: &[usize],
    ) -> Result<(), FlashAttentionError> {
        let [_, page_size, kv_heads, head_dim] = self.buffers.keys().dims();
        let value_dim = self.buffers.values().dims()[3];
        let batch = self.lengths.len();
        let n = keys.dims()[2];
        check_new(
            "keys",
            self.buffers.keys(),
            &keys,
            [batch, kv_heads, n, head_dim],
        )?;
        check_new(
            "values",
            self.buffers.values(),
            &values,
            [batch, kv_heads, n, value_dim],
        )?;
        check_counts(counts, batch, n)?;
        let needed: usize = (self.lengths.iter().zip(&self.tables).zip(counts))
            .map(|((len, table), count)| (len + count).div_ceil(page_size) - table.len())
            .sum();
        if needed > self.free.len() {
            return Err(FlashAttentionError::PagesExhausted {
                free: self.free.len(),
                needed,
            });
        }
        // The row of the pool each new position goes to, and the row of the new block it
        // comes from.
        let (mut slots, mut sources) = (Vec::new(), Vec::new());
        let sequences = self.lengths.iter_mut().zip(&mut self.tables).zip(counts);
        for (seq, ((length, table), &count)) in sequences.enumerate() {
            while table.len() * page_size < *length + count {
                table.push(self.free.pop().expect("the free pages were counted"));
            }
            for i in 0..count {
                let position = *length + i;
                let page = table[position / page_size] as usize;
                slots.push((page * page_size + position % page_size) as i64);
                sources.push((seq * n + i) as i64);
            }
            *length += count;
        }
        if slots.is_empty() {
            return Ok(());
        }
        let device = keys.device();
        let index = |rows: Vec<i64>| {
            let len = rows.len();
            Tensor::<1, Int>::from_data(TensorData::new(rows, [len]), &device)
        };
        let every_row = sources.len() == batch * n;
        let (slots, sources) = (index(slots), index(sources));
        // `[batch, kv_heads, n, dim]` as rows `[batch · n, kv_heads, dim]`, those kept.
        let rows = |new: Tensor<4>| {
            let dim = new.dims()[3];
            let rows = new.swap_dims(1, 2).reshape([batch * n, kv_heads, dim]);
            if every_row {
                rows
            } else {
                rows.select(0, sources.clone())
            }
        };
        let scatter = |pool: Tensor<4>, new: Tensor<4>| {
            let dims = pool.dims();
            pool.reshape([dims[0] * page_size, kv_heads, dims[3]])
                .select_assign(0, slots.clone(), rows(new), IndexingUpdateOp::Assign)
                .reshape(dims)
        };
        let (pool_keys, pool_values) = self.buffers.take();
        self.buffers
            .put(scatter(pool_keys, keys), scatter(pool_values, values));
        Ok(())
    }

    /// Attention of `q: [batch, heads, n, head_dim]`, the queries of each sequence's last `n`
    /// positions, over its filled part: `[batch, heads, n, value_dim]`, as
    /// [`KvCache::attend`](crate::KvCache::attend) (causal per sequence with `options.causal`,
    /// the other options on each sequence's own diagonal).
    ///
    /// # Example
    ///
    /// ```no_run
    /// use burn::tensor::{DType, Device, Distribution, Tensor};
    /// use burn_flash::{FlashAttentionOptions, PagedKvCache};
    ///
    /// let device = Device::wgpu(Default::default());
    /// let random = |dims| Tensor::<4>::random(dims, Distribution::Normal(0.0, 1.0), &device);
    /// let mut cache = PagedKvCache::new(4, 64, 1, [4, 64], 64, DType::F32, &device).unwrap();
    /// cache.append(random([1, 4, 20, 64]), random([1, 4, 20, 64])).unwrap();
    /// let out = cache.attend(random([1, 8, 20, 64]), FlashAttentionOptions::causal()).unwrap();
    /// assert_eq!(out.dims(), [1, 8, 20, 64]);
    /// ```
    pub fn attend(
        &self,
        q: Tensor<4>,
        options: FlashAttentionOptions,
    ) -> Result<Tensor<4>, FlashAttentionError> {
        let batch = self.lengths.len();
        let device = q.device();
        // Rows of the table past a sequence's pages are never read: page 0 stands there.
        let per_sequence = self.tables.iter().map(Vec::len).max().unwrap_or(0);
        let mut table = vec![0u32; batch * per_sequence];
        for (row, pages) in table.chunks_mut(per_sequence.max(1)).zip(&self.tables) {
            row[..pages.len()].copy_from_slice(pages);
        }
        let table =
            Tensor::<2, Int>::from_data(TensorData::new(table, [batch, per_sequence]), &device);
        let lengths: Vec<u32> = self.lengths.iter().map(|&len| len as u32).collect();
        let lengths = Tensor::<1, Int>::from_data(TensorData::new(lengths, [batch]), &device);
        try_flash_attention_paged(
            q,
            self.buffers.keys().clone(),
            self.buffers.values().clone(),
            table,
            lengths,
            options,
        )
    }
}
