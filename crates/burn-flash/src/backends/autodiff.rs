//! [`FlashAttentionBackend`] for `Autodiff<B>`: the fused forward becomes one node of the graph
//! whose backward runs the fused backward kernels. It saves `q`, `k`, `v`, the output and the
//! log-sum-exp: no `seq_q × seq_k` tensor is kept between the passes.

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
};
use crate::{FlashAttentionOptions, TilePath};

/// The graph node of one fused attention call.
#[derive(Debug)]
struct FlashAttentionNode;

/// What the backward needs: the inputs, the output, its log-sum-exp and the options.
type Saved<B> = ([FloatTensor<B>; 5], FlashAttentionOptions);

impl<B: FlashAttentionBackend> Backward<B, 3> for FlashAttentionNode {
    type State = Saved<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let ([q, k, v, output, lse], options) = ops.state;
        let grad_output = grads.consume::<B>(&ops.node);
        let FlashAttentionGrads {
            q: dq,
            k: dk,
            v: dv,
        } = B::flash_attention_backward(q, k, v, output, lse, grad_output, options);
        for (parent, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(parent) = parent {
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
        options: FlashAttentionOptions,
    ) -> FlashAttentionForward<Self> {
        let forward = B::flash_attention_forward(
            q.primitive.clone(),
            k.primitive.clone(),
            v.primitive.clone(),
            options,
        );
        // The log-sum-exp is an output without a gradient of its own.
        let lse = <Self as AutodiffBackend>::from_inner(forward.lse.clone());
        let output = match FlashAttentionNode
            .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let saved = [
                    q.primitive,
                    k.primitive,
                    v.primitive,
                    forward.output.clone(),
                    forward.lse,
                ];
                prep.finish((saved, options), forward.output)
            }
            OpsKind::UnTracked(prep) => prep.finish(forward.output),
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
        output: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad_output: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionGrads<Self> {
        let grads = B::flash_attention_backward(
            q.primitive,
            k.primitive,
            v.primitive,
            output.primitive,
            lse.primitive,
            grad_output.primitive,
            options,
        );
        FlashAttentionGrads {
            q: <Self as AutodiffBackend>::from_inner(grads.q),
            k: <Self as AutodiffBackend>::from_inner(grads.k),
            v: <Self as AutodiffBackend>::from_inner(grads.v),
        }
    }
}
