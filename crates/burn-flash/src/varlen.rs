//! Variable-length batches: sequences of different lengths packed one after another along the
//! rows of `[total, heads, dim]` tensors (FlashAttention-2's `flash_attn_varlen_func` layout),
//! each attended on its own, no work spent on padding. The packing is described once on the
//! host ([`PackedSequences`]) and serves every layer of a model.

use burn::backend::Dispatch;
use burn::tensor::ops::CausalAlignment;
use burn::tensor::{DType, Device, Int, IntDType, Tensor, TensorData};

use crate::api::{FlashAttentionPlan, Plan, padded_to, plan_problem, validate_heads};
use crate::backend::{FlashAttentionBackend, FlashAttentionProblem, PackedStarts};
use crate::error::FlashAttentionError;
use crate::lengths::try_flash_attention_with_lengths;
use crate::options::FlashAttentionOptions;

/// How a batch of sequences of different lengths is packed along the rows of its query, key
/// and value tensors: sequence `b` owns query rows `q_start(b)..q_start(b) + query_lengths[b]`
/// and key rows alike, in order, with nothing between them (FlashAttention-2's `cu_seqlens`).
/// Built on the host from the lengths, which a data loader knows, and uploaded once to
/// `device`: one value serves every attention call of a forward pass.
///
/// # Example
///
/// ```no_run
/// use burn::tensor::Device;
/// use burn_flash::PackedSequences;
///
/// let device = Device::wgpu(Default::default());
/// // Three documents of 900, 17 and 311 tokens in one batch of 1228 rows.
/// let packed = PackedSequences::new(&[900, 17, 311], &device);
/// assert_eq!((packed.len(), packed.total_queries(), packed.max_query()), (3, 1228, 900));
/// ```
#[derive(Clone, Debug)]
pub struct PackedSequences {
    query_lengths: Vec<usize>,
    key_lengths: Vec<usize>,
    /// `[2, sequences + 1]`, u32 where the device has it: cumulative query and key lengths.
    starts: Tensor<2, Int>,
}

impl PackedSequences {
    /// Sequences whose queries and keys are the same rows (self-attention), of these lengths.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use burn::tensor::Device;
    /// use burn_flash::PackedSequences;
    ///
    /// let packed = PackedSequences::new(&[5, 0, 12], &Device::wgpu(Default::default()));
    /// assert_eq!(packed.key_lengths(), &[5, 0, 12]);
    /// ```
    pub fn new(lengths: &[usize], device: &Device) -> Self {
        Self::build(lengths.to_vec(), lengths.to_vec(), device)
    }

    /// Sequences with queries and keys of their own lengths (cross-attention, or new queries
    /// over a longer context: causal alignment places the last query on the last key).
    /// Refused where the two lists differ in length
    /// ([`FlashAttentionError::PackedLengths`]).
    ///
    /// # Example
    ///
    /// ```no_run
    /// use burn::tensor::Device;
    /// use burn_flash::PackedSequences;
    ///
    /// let device = Device::wgpu(Default::default());
    /// let packed = PackedSequences::with_keys(&[1, 4], &[300, 40], &device).unwrap();
    /// assert_eq!((packed.total_queries(), packed.total_keys()), (5, 340));
    /// ```
    pub fn with_keys(
        query_lengths: &[usize],
        key_lengths: &[usize],
        device: &Device,
    ) -> Result<Self, FlashAttentionError> {
        if query_lengths.len() != key_lengths.len() {
            return Err(FlashAttentionError::PackedLengths {
                queries: query_lengths.len(),
                keys: key_lengths.len(),
            });
        }
        Ok(Self::build(
            query_lengths.to_vec(),
            key_lengths.to_vec(),
            device,
        ))
    }

    fn build(query_lengths: Vec<usize>, key_lengths: Vec<usize>, device: &Device) -> Self {
        let mut values = Vec::with_capacity(2 * (query_lengths.len() + 1));
        for lengths in [&query_lengths, &key_lengths] {
            let mut total = 0usize;
            values.push(0i32);
            for &n in lengths {
                total += n;
                values.push(i32::try_from(total).expect("packed rows fit 32-bit signed integers"));
            }
        }
        let data = TensorData::new(values, [2, query_lengths.len() + 1]);
        // The kernel reads u32, cast on the device from i32, which every runtime has.
        let starts = Tensor::<2, Int>::from_data(data, (device, DType::I32)).cast(IntDType::U32);
        Self {
            query_lengths,
            key_lengths,
            starts,
        }
    }

    /// Sequences in the batch.
    pub fn len(&self) -> usize {
        self.query_lengths.len()
    }

    /// Whether the batch has no sequence.
    pub fn is_empty(&self) -> bool {
        self.query_lengths.is_empty()
    }

    /// Each sequence's queries.
    pub fn query_lengths(&self) -> &[usize] {
        &self.query_lengths
    }

    /// Each sequence's keys.
    pub fn key_lengths(&self) -> &[usize] {
        &self.key_lengths
    }

    /// Query rows of the packed batch.
    pub fn total_queries(&self) -> usize {
        self.query_lengths.iter().sum()
    }

    /// Key rows of the packed batch.
    pub fn total_keys(&self) -> usize {
        self.key_lengths.iter().sum()
    }

    /// The longest sequence's queries (0 without sequences).
    pub fn max_query(&self) -> usize {
        self.query_lengths.iter().copied().max().unwrap_or(0)
    }

    /// The longest sequence's keys (0 without sequences).
    pub fn max_key(&self) -> usize {
        self.key_lengths.iter().copied().max().unwrap_or(0)
    }

    /// The device the starts were uploaded to.
    pub fn device(&self) -> Device {
        self.starts.device()
    }
}

/// Attention over a batch of sequences of different lengths packed along the rows:
/// `q: [total_q, heads, head_dim]`, `k: [total_k, kv_heads, head_dim]`, `v: [total_k,
/// kv_heads, value_dim]`, sequence `b` in the rows `sequences` gives it, attending to its own
/// keys only. Returns `[total_q, heads, value_dim]`. The options apply per sequence: the causal
/// diagonal, a window and ALiBi's distances are placed on each sequence's own lengths
/// (bottom-right: its last query sits on its last key; or top-left); rows that see no key are
/// 0.
///
/// Where the fused kernel runs the inputs, one fused forward reads each sequence's rows in
/// place, and only its row blocks and key blocks are computed: no work on padding. On an
/// autodiff device it records one node whose backward runs the fused packed backward (each
/// sequence's key blocks own their gradients; dQ by its own launch, deterministic). Dropout
/// draws each sequence's decisions as batch entry `b` of the packing, its rows counted from
/// its own first ones. Otherwise (no fused kernel for the inputs) the sequences are gathered
/// into a padded `[sequences, heads, longest, dim]` batch on the device and attended
/// by [`try_flash_attention_with_lengths`] (differentiable; ALiBi is refused there), and the
/// output rows gathered back: correct, and as costly as the padded batch.
///
/// Refused: row counts other than `sequences`' totals ([`FlashAttentionError::PackedRows`]),
/// keys and values of different row counts, heads or head dims that do not fit together,
/// inputs of different dtypes or devices, `sequences` uploaded to another device, and the
/// options [`try_flash_attention`](crate::try_flash_attention) refuses.
///
/// # Example
///
/// ```no_run
/// use burn::tensor::{Device, Distribution, Tensor};
/// use burn_flash::{try_flash_attention_varlen, FlashAttentionOptions, PackedSequences};
///
/// let device = Device::wgpu(Default::default());
/// let packed = PackedSequences::new(&[900, 17, 311], &device);
/// let random = |dims| Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), &device);
/// let (q, k, v) = (random([1228, 8, 64]), random([1228, 2, 64]), random([1228, 2, 64]));
/// let out = try_flash_attention_varlen(q, k, v, &packed, FlashAttentionOptions::causal())
///     .unwrap();
/// assert_eq!(out.dims(), [1228, 8, 64]);
/// ```
pub fn try_flash_attention_varlen(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    sequences: &PackedSequences,
    options: FlashAttentionOptions,
) -> Result<Tensor<3>, FlashAttentionError> {
    let ([total_q, heads, head_dim], [total_k, kv_heads, k_dim], [v_rows, v_heads, value_dim]) =
        (q.dims(), k.dims(), v.dims());
    for (input, expected, got) in [
        ("q", sequences.total_queries(), total_q),
        ("k", sequences.total_keys(), total_k),
    ] {
        if expected != got {
            return Err(FlashAttentionError::PackedRows {
                input,
                expected,
                got,
            });
        }
    }
    if v_rows != total_k {
        return Err(FlashAttentionError::KeyValueLengthMismatch {
            k: total_k,
            v: v_rows,
        });
    }
    validate_heads(heads, kv_heads, v_heads, head_dim, k_dim)?;
    // `[total, heads, dim]` as the `[1, heads, total, dim]` views the kernels read.
    let rows = |t: Tensor<3>| t.unsqueeze_dim::<4>(0).swap_dims(1, 2);
    let (q, k, v) = (rows(q), rows(k), rows(v));
    let dtype = crate::api::validate_types(&q, &k, &v)?;
    let device = q.device();
    if sequences.device() != device {
        return Err(FlashAttentionError::InputDevice {
            input: "packed sequences",
            expected: format!("{device:?}"),
            got: format!("{:?}", sequences.device()),
        });
    }
    let (batch, max_q, max_k) = (sequences.len(), sequences.max_query(), sequences.max_key());
    let problem = FlashAttentionProblem::new(
        [batch, heads, max_q, head_dim],
        [batch, kv_heads, max_k, head_dim],
        [batch, kv_heads, max_k, value_dim],
        dtype,
        options.causal,
    );
    let Plan { scale, route, .. } = plan_problem(problem, options, &device)?;
    let options = options.with_scale(scale);
    if route == FlashAttentionPlan::Zeros || total_k == 0 {
        return Ok(Tensor::zeros([total_q, heads, value_dim], (&device, dtype)));
    }
    if !route.is_fused() || head_dim == 0 {
        return padded(q, k, v, sequences, options);
    }
    let (q, k, v) = padded_to(&route, q, k, v);
    let forward = <Dispatch as FlashAttentionBackend>::flash_attention_forward_packed(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        PackedStarts {
            starts: sequences.starts.clone().into_dispatch(),
            max_query: max_q,
            max_key: max_k,
        },
        options,
    );
    // `[1, heads, total_q, dim]` in `[total_q, heads, dim]` order: swapped back, contiguous.
    let output = Tensor::<4>::from_dispatch(forward.output).swap_dims(1, 2);
    let output = if output.dims()[3] == value_dim {
        output
    } else {
        output.narrow(3, 0, value_dim)
    };
    Ok(output.squeeze_dim::<3>(0))
}

/// [`try_flash_attention_varlen`] through a padded batch: `q`, `k`, `v` (`[1, heads, total,
/// dim]` views) gathered into `[sequences, heads, longest, dim]`, attended with each
/// sequence's key length, and the output rows gathered back into `[total_q, heads, dim]`.
/// Queries are padded before a sequence's rows where the diagonal is bottom-right (so that its
/// last query is the padded batch's last row, as the lengths function places it), after them
/// where it is top-left (so that query `i` stays row `i`).
fn padded(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    sequences: &PackedSequences,
    options: FlashAttentionOptions,
) -> Result<Tensor<3>, FlashAttentionError> {
    let device = q.device();
    let (batch, max_q, max_k) = (sequences.len(), sequences.max_query(), sequences.max_key());
    let leading = |length: usize| match options.causal_alignment {
        CausalAlignment::BottomRight => max_q - length,
        CausalAlignment::TopLeft => 0,
    };
    // Padding rows read row 0 (every input has one here): hidden from every query, or
    // discarded, they add nothing to the output or the gradients.
    let (mut q_rows, mut out_rows, mut k_rows) = (Vec::new(), Vec::new(), Vec::new());
    let (mut q_start, mut k_start) = (0usize, 0usize);
    let lengths = sequences.query_lengths.iter().zip(&sequences.key_lengths);
    for (b, (&lq, &lk)) in lengths.enumerate() {
        let lead = leading(lq);
        for row in 0..max_q {
            let inside = row >= lead && row < lead + lq;
            q_rows.push(if inside { q_start + row - lead } else { 0 });
        }
        out_rows.extend((0..lq).map(|i| b * max_q + lead + i));
        k_rows.extend((0..max_k).map(|key| if key < lk { k_start + key } else { 0 }));
        q_start += lq;
        k_start += lk;
    }
    let index = |rows: Vec<usize>| {
        let rows: Vec<i32> = rows.into_iter().map(|n| n as i32).collect();
        let len = rows.len();
        Tensor::<1, Int>::from_data(TensorData::new(rows, [len]), (&device, DType::I32))
    };
    let gather = |t: Tensor<4>, rows: Vec<usize>, length: usize| {
        let [_, heads, _, dim] = t.dims();
        t.squeeze_dim::<3>(0)
            .swap_dims(0, 1)
            .select(0, index(rows))
            .reshape([batch, length, heads, dim])
            .swap_dims(1, 2)
    };
    let out = try_flash_attention_with_lengths(
        gather(q, q_rows, max_q),
        gather(k, k_rows.clone(), max_k),
        gather(v, k_rows, max_k),
        index(sequences.key_lengths.clone()),
        options,
    )?;
    let [_, heads, _, value_dim] = out.dims();
    Ok(out
        .swap_dims(1, 2)
        .reshape([batch * max_q, heads, value_dim])
        .select(0, index(out_rows)))
}
