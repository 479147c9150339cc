//! [`FlashAttentionBackend`] for `CubeBackend`: the kernels of [`crate::kernel`], on any CubeCL
//! runtime.

use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorMetadata;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::backend::{
    FlashAttentionBackend, FlashAttentionForward, FlashAttentionGrads, FlashAttentionProblem,
};
use crate::{kernel, FlashAttentionOptions, TilePath};

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
        if problem.kv_heads != problem.heads {
            return Err(format!(
                "grouped key/value heads are not supported yet ({} query heads, {} key/value heads)",
                problem.heads, problem.kv_heads
            ));
        }
        let client = R::client(device);
        kernel::support(&client, problem.dtype, problem.head_dim, problem.value_dim)
    }

    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionForward<Self> {
        let head_dim = q.shape()[3];
        let scale = options.scale_for(head_dim) as f32;
        let (output, lse) = kernel::forward(q, k, v, options.causal, scale);
        FlashAttentionForward { output, lse }
    }

    fn flash_attention_backward_support(
        device: &R::Device,
        problem: &FlashAttentionProblem,
    ) -> Result<(), String> {
        if problem.kv_heads != problem.heads {
            return Err("grouped key/value heads are not supported yet".into());
        }
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
        let scale = options.scale_for(q.shape()[3]) as f32;
        let (q, k, v) = kernel::backward(q, k, v, output, lse, grad_output, options.causal, scale);
        FlashAttentionGrads { q, k, v }
    }
}
