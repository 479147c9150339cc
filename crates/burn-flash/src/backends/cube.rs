//! [`FlashAttentionBackend`] for `CubeBackend`: the kernels of [`crate::kernel`], on any CubeCL
//! runtime.

use burn::tensor::TensorMetadata;
use burn::tensor::ops::FloatTensor;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::backend::{
    FlashAttentionBackend, FlashAttentionForward, FlashAttentionGrads, FlashAttentionProblem,
};
use crate::{FlashAttentionOptions, TilePath, kernel};

impl<R, F, I, BT> FlashAttentionBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn flash_attention_support(
        device: &R::Device,
        problem: &FlashAttentionProblem,
    ) -> Result<TilePath, String> {
        let client = R::client(device);
        kernel::support(&client, problem.dtype, problem.head_dim, problem.value_dim)
    }

    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionForward<Self> {
        let params = score_params(&q, &k, &options);
        let (output, lse) = kernel::forward(q, k, v, params);
        FlashAttentionForward { output, lse }
    }

    fn flash_attention_backward_support(
        device: &R::Device,
        problem: &FlashAttentionProblem,
    ) -> Result<(), String> {
        let client = R::client(device);
        kernel::backward_support(&client, problem.dtype, problem.head_dim, problem.value_dim)
            .map(|_tile| ())
    }

    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        output: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_output: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionGrads<Self> {
        let params = score_params(&q, &k, &options);
        let (q, k, v) = kernel::backward(
            q,
            k,
            v,
            output,
            lse,
            grad_output,
            params,
            options.deterministic,
        );
        FlashAttentionGrads { q, k, v }
    }
}

/// The kernels' view of `options` for these queries and keys.
fn score_params<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    options: &FlashAttentionOptions,
) -> kernel::ScoreParams {
    let ([_, _, seq_q, head_dim], [_, _, seq_k, _]) = (q.shape().dims(), k.shape().dims());
    kernel::ScoreParams::new(options, head_dim, seq_q, seq_k)
}
