//! [`FlashAttentionBackend`] for `CubeBackend`: the kernels of [`crate::kernel`], on every CubeCL
//! runtime. Burn's `CubeTensor` and the kernels' `KernelTensor` hold the same fields: the
//! conversions move the buffer, nothing is copied.

use burn::backend::TensorMetadata;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::{BoolTensor, FloatTensor, IntTensor};
use burn::tensor::{BoolStore, DType};
use burn_backend::cubecl::{dtype_to_elem_type, elem_type_to_dtype};
use burn_cubecl::kernel::{bool_cast, cast};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeDevice};

use crate::backend::{
    BiasGrad, FlashAttentionBackend, FlashAttentionForward, FlashAttentionGrads, KeyCache,
    PackedStarts, ScoreInputs,
};
use crate::kernel::{self, KernelTensor};
use crate::options::FlashAttentionOptions;

/// The kernels' view of a Burn tensor.
fn to_kernel(tensor: CubeTensor) -> KernelTensor {
    KernelTensor {
        client: tensor.client,
        handle: tensor.handle,
        meta: tensor.meta,
        dtype: dtype_to_elem_type(tensor.dtype),
    }
}

/// A kernel's output as a Burn tensor of `device`.
fn from_kernel(tensor: KernelTensor, device: &CubeDevice) -> CubeTensor {
    CubeTensor::new(
        tensor.client,
        tensor.handle,
        *tensor.meta,
        device.clone(),
        elem_type_to_dtype(tensor.dtype),
    )
}

/// The score inputs as the kernels read them: a mask of native booleans becomes bytes.
fn kernel_inputs(inputs: ScoreInputs<CubeBackend>) -> kernel::ScoreInputs {
    let (mask, bias) = inputs.into_parts();
    let mask = mask.map(|mask: BoolTensor<CubeBackend>| match mask.dtype {
        DType::Bool(BoolStore::Native) => bool_cast(mask, DType::U8),
        _ => mask,
    });
    kernel::ScoreInputs::new(mask.map(to_kernel), bias.map(to_kernel))
}

/// An integer tensor in `dtype`, cast only where it is in another.
fn in_dtype(t: IntTensor<CubeBackend>, dtype: DType) -> CubeTensor {
    if t.dtype == dtype { t } else { cast(t, dtype) }
}

/// The kernels' view of packed sequences, and the score parameters over the longest one
/// (its diagonal placed per sequence, so top-left stays top-left whatever the lengths).
fn packed_rows(
    sequences: PackedStarts<CubeBackend>,
    q: &CubeTensor,
    options: &FlashAttentionOptions,
) -> (kernel::PackedRows, kernel::ScoreParams) {
    let PackedStarts {
        starts,
        max_query,
        max_key,
    } = sequences;
    let shape = q.shape();
    let params = kernel::ScoreParams::new(options, shape[1], shape[3], max_query, max_key)
        .with_key_lengths(options);
    let packed = kernel::PackedRows {
        starts: to_kernel(in_dtype(starts, DType::U32)),
        max_query,
        max_key,
    };
    (packed, params)
}

/// The kernels' view of `options` for these queries and keys.
fn score_params(
    q: &CubeTensor,
    k: &CubeTensor,
    options: &FlashAttentionOptions,
) -> kernel::ScoreParams {
    let (q, k) = (q.shape(), k.shape());
    kernel::ScoreParams::new(options, q[1], q[3], q[2], k[2])
}

impl FlashAttentionBackend for CubeBackend {
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        inputs: ScoreInputs<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionForward<Self> {
        let params = score_params(&q, &k, &options);
        let device = q.device.clone();
        let (output, lse) = kernel::forward(
            to_kernel(q),
            to_kernel(k),
            to_kernel(v),
            kernel_inputs(inputs),
            None,
            params,
        );
        FlashAttentionForward {
            output: from_kernel(output, &device),
            lse: from_kernel(lse, &device),
        }
    }

    fn flash_attention_forward_cached(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        keys: KeyCache<Self>,
        options: FlashAttentionOptions,
    ) -> FloatTensor<Self> {
        // The kernel reads u32 or i32 lengths (those past the keys count as all of them, negative
        // ones as none) and tables.
        // Pages `[pages, page_size, kv_heads, dim]` are read as `[pages, kv_heads, page_size,
        // dim]`, in place.
        let (k, v, cached, seq_k) = match keys {
            KeyCache::Lengths(lengths) => {
                let seq_k = k.shape()[2];
                (k, v, (lengths, None), seq_k)
            }
            KeyCache::Paged(lengths, table) => {
                let seq_k = table.shape()[1] * k.shape()[1];
                let (k, v) = (
                    Self::float_swap_dims(k, 1, 2),
                    Self::float_swap_dims(v, 1, 2),
                );
                (k, v, (lengths, Some(table)), seq_k)
            }
        };
        let shape = q.shape();
        let params = kernel::ScoreParams::new(&options, shape[1], shape[3], shape[2], seq_k)
            .with_key_lengths(&options);
        let device = q.device.clone();
        // Burn's default i32, and u32, cost no cast per call; the table follows the lengths.
        let dtype = match cached.0.dtype {
            DType::U32 => DType::U32,
            _ => DType::I32,
        };
        let cached = kernel::CachedKeys {
            lengths: to_kernel(in_dtype(cached.0, dtype)),
            block_table: cached.1.map(|table| to_kernel(in_dtype(table, dtype))),
        };
        let (output, _) = kernel::forward(
            to_kernel(q),
            to_kernel(k),
            to_kernel(v),
            kernel::ScoreInputs::new(None, None),
            Some(cached),
            params,
        );
        from_kernel(output, &device)
    }

    fn flash_attention_forward_packed(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        sequences: PackedStarts<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionForward<Self> {
        let (packed, params) = packed_rows(sequences, &q, &options);
        let device = q.device.clone();
        let (output, lse) =
            kernel::forward_packed(to_kernel(q), to_kernel(k), to_kernel(v), packed, params);
        FlashAttentionForward {
            output: from_kernel(output, &device),
            lse: from_kernel(lse, &device),
        }
    }

    fn flash_attention_backward_packed(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        sequences: PackedStarts<Self>,
        output: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_output: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionGrads<Self> {
        let (packed, params) = packed_rows(sequences, &q, &options);
        let device = q.device.clone();
        let grads = kernel::backward_packed(
            to_kernel(q),
            to_kernel(k),
            to_kernel(v),
            to_kernel(output),
            to_kernel(lse),
            to_kernel(grad_output),
            packed,
            params,
        );
        FlashAttentionGrads {
            q: from_kernel(grads.q, &device),
            k: from_kernel(grads.k, &device),
            v: from_kernel(grads.v, &device),
            bias: BiasGrad::Absent,
        }
    }

    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        inputs: ScoreInputs<Self>,
        output: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_output: FloatTensor<Self>,
        options: FlashAttentionOptions,
        bias_grad: bool,
    ) -> FlashAttentionGrads<Self> {
        let params = score_params(&q, &k, &options);
        let device = q.device.clone();
        let bias_shape = inputs.bias().map(|bias| bias.shape());
        let grads = kernel::backward(
            to_kernel(q),
            to_kernel(k),
            to_kernel(v),
            kernel_inputs(inputs),
            to_kernel(output),
            to_kernel(lse),
            to_kernel(grad_output),
            params,
            options.deterministic,
            bias_grad,
        );
        // The kernel writes the scores' gradient per (batch, head, query); a bias broadcast
        // over some of them gets its sum.
        let bias = grads.bias.zip(bias_shape).map(|(grad, shape)| {
            let mut grad = from_kernel(grad, &device);
            for (dim, &size) in shape.iter().enumerate().take(3) {
                if size == 1 && grad.shape()[dim] != 1 {
                    grad = Self::float_sum_dim(grad, dim);
                }
            }
            grad
        });
        FlashAttentionGrads {
            q: from_kernel(grads.q, &device),
            k: from_kernel(grads.k, &device),
            v: from_kernel(grads.v, &device),
            bias: bias.map_or(BiasGrad::Absent, BiasGrad::Present),
        }
    }
}
