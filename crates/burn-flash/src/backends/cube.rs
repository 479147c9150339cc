//! [`FlashAttentionBackend`] for `CubeBackend`: the kernels of [`crate::kernel`], on any CubeCL
//! runtime.

use burn::tensor::TensorMetadata;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::backend::{
    FlashAttentionBackend, FlashAttentionForward, FlashAttentionGrads, FlashAttentionProblem,
    ScoreInputs,
};
use crate::kernel::{self, TilePath};
use crate::options::FlashAttentionOptions;

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
        inputs: ScoreInputs<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionForward<Self> {
        let params = score_params(&q, &k, &options);
        let inputs = kernel::ScoreInputs::new(inputs.mask, inputs.bias);
        let (output, lse) = kernel::forward(q, k, v, inputs, params);
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
        inputs: ScoreInputs<Self>,
        output: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_output: FloatTensor<Self>,
        options: FlashAttentionOptions,
        bias_grad: bool,
    ) -> FlashAttentionGrads<Self> {
        let params = score_params(&q, &k, &options);
        let bias_shape = inputs.bias.as_ref().map(|bias| bias.shape().dims::<4>());
        let inputs = kernel::ScoreInputs::new(inputs.mask, inputs.bias);
        let grads = kernel::backward(
            q,
            k,
            v,
            inputs,
            output,
            lse,
            grad_output,
            params,
            options.deterministic,
            bias_grad,
        );
        // The kernel writes the scores' gradient per (batch, head, query); a bias broadcast
        // over some of them gets its sum.
        let bias = grads.bias.zip(bias_shape).map(|(mut grad, shape)| {
            for (dim, &size) in shape.iter().enumerate().take(3) {
                if size == 1 && grad.shape()[dim] != 1 {
                    grad = Self::float_sum_dim(grad, dim);
                }
            }
            grad
        });
        FlashAttentionGrads {
            q: grads.q,
            k: grads.k,
            v: grads.v,
            bias,
        }
    }
}

/// The kernels' view of `options` for these queries and keys.
fn score_params<R: CubeRuntime>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    options: &FlashAttentionOptions,
) -> kernel::ScoreParams {
    let ([_, heads, seq_q, head_dim], [_, _, seq_k, _]) = (q.shape().dims(), k.shape().dims());
    kernel::ScoreParams::new(options, heads, head_dim, seq_q, seq_k)
}
