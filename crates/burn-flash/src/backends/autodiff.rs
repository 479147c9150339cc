//! [`FlashAttentionBackend`] for `Autodiff<B>`: the fused forward becomes one node of the graph
//! whose backward runs the fused backward kernels. It saves `q`, `k`, `v`, the mask and bias
//! inputs, the output and the log-sum-exp: no `seq_q × seq_k` tensor is kept between the passes
//! beyond the inputs themselves.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::Device;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;

use crate::backend::{
    FlashAttentionBackend, FlashAttentionForward, FlashAttentionGrads, FlashAttentionProblem,
    ScoreInputs,
};
use crate::kernel::TilePath;
use crate::options::FlashAttentionOptions;

/// The graph node of one fused attention call with `N` parents: `q`, `k`, `v`, and the bias
/// when it is tracked (`N = 4`).
#[derive(Debug)]
struct FlashAttentionNode<const N: usize>;

/// What the backward needs: the inputs, the output, its log-sum-exp and the options.
#[derive(Debug, Clone)]
struct Saved<B: FlashAttentionBackend> {
    tensors: [FloatTensor<B>; 5],
    inputs: ScoreInputs<B>,
    options: FlashAttentionOptions,
}

impl<B: FlashAttentionBackend, const N: usize> Backward<B, N> for FlashAttentionNode<N> {
    type State = Saved<B>;

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let Saved {
            tensors: [q, k, v, output, lse],
            inputs,
            options,
        } = ops.state;
        let grad_output = grads.consume::<B>(&ops.node);
        let bias_grad = N == 4 && ops.parents[3].is_some();
        let FlashAttentionGrads {
            q: dq,
            k: dk,
            v: dv,
            bias: dbias,
        } = B::flash_attention_backward(
            q,
            k,
            v,
            inputs,
            output,
            lse,
            grad_output,
            options,
            bias_grad,
        );
        for (parent, grad) in ops
            .parents
            .into_iter()
            .zip([Some(dq), Some(dk), Some(dv), dbias])
        {
            if let (Some(parent), Some(grad)) = (parent, grad) {
                grads.register::<B>(parent.id, grad);
            }
        }
    }
}

impl<B: FlashAttentionBackend, C: CheckpointStrategy> FlashAttentionBackend for Autodiff<B, C> {
    /// The fused forward is used under autodiff only where the fused backward can follow it.
    fn flash_attention_support(
        device: &Device<Self>,
        problem: &FlashAttentionProblem,
    ) -> Result<TilePath, String> {
        let tile = B::flash_attention_support(device, problem)?;
        B::flash_attention_backward_support(device, problem)?;
        Ok(tile)
    }

    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        inputs: ScoreInputs<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionForward<Self> {
        let inner = ScoreInputs::<B> {
            mask: inputs.mask,
            bias: inputs.bias.as_ref().map(|bias| bias.primitive.clone()),
        };
        let forward = B::flash_attention_forward(
            q.primitive.clone(),
            k.primitive.clone(),
            v.primitive.clone(),
            inner.clone(),
            options,
        );
        // The log-sum-exp is an output without a gradient of its own.
        let lse = <Self as AutodiffBackend>::from_inner(forward.lse.clone());
        let state = || Saved {
            tensors: [
                q.primitive.clone(),
                k.primitive.clone(),
                v.primitive.clone(),
                forward.output.clone(),
                forward.lse.clone(),
            ],
            inputs: inner,
            options,
        };
        // One node over q, k, v, and the bias when there is one.
        macro_rules! record {
            ($n:literal, $parents:expr) => {
                match FlashAttentionNode::<$n>
                    .prepare::<C>($parents)
                    .compute_bound()
                    .stateful()
                {
                    OpsKind::Tracked(prep) => prep.finish(state(), forward.output),
                    OpsKind::UnTracked(prep) => prep.finish(forward.output),
                }
            };
        }
        let output = match inputs.bias {
            Some(bias) => record!(4, [q.node, k.node, v.node, bias.node]),
            None => record!(3, [q.node, k.node, v.node]),
        };
        FlashAttentionForward { output, lse }
    }

    fn flash_attention_backward_support(
        device: &Device<Self>,
        problem: &FlashAttentionProblem,
    ) -> Result<(), String> {
        B::flash_attention_backward_support(device, problem)
    }

    /// The gradients of the inner backend, as untracked tensors (no second-order graph).
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
        let grads = B::flash_attention_backward(
            q.primitive,
            k.primitive,
            v.primitive,
            ScoreInputs {
                mask: inputs.mask,
                bias: inputs.bias.map(|bias| bias.primitive),
            },
            output.primitive,
            lse.primitive,
            grad_output.primitive,
            options,
            bias_grad,
        );
        let untracked = <Self as AutodiffBackend>::from_inner;
        FlashAttentionGrads {
            q: untracked(grads.q),
            k: untracked(grads.k),
            v: untracked(grads.v),
            bias: grads.bias.map(untracked),
        }
    }
}
