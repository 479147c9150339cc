//! [`FlashAttentionBackend`] for `Autodiff<B>`: the fused forward becomes one node of the graph
//! whose backward runs the fused backward kernels. It saves `q`, `k`, `v`, the mask and bias
//! inputs, the output and the log-sum-exp: no `seq_q × seq_k` tensor is kept between the passes
//! beyond the inputs themselves.

use burn::backend::AutodiffBackend;
use burn::backend::tensor::FloatTensor;
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use crate::backend::{
    BiasGrad, FlashAttentionBackend, FlashAttentionForward, FlashAttentionGrads, KeyCache,
    PackedStarts, ScoreInputs,
};
use crate::options::FlashAttentionOptions;

/// The graph node of one fused attention call with `N` parents: `q`, `k`, `v`, and the bias
/// when there is one (`N = 4`).
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
        for (parent, grad) in
            ops.parents
                .into_iter()
                .zip([Some(dq), Some(dk), Some(dv), dbias.into_option()])
        {
            if let (Some(parent), Some(grad)) = (parent, grad) {
                grads.register::<B>(parent.id, grad);
            }
        }
    }
}

/// The graph node of one packed attention call over `q`, `k` and `v`.
#[derive(Debug)]
struct PackedNode;

/// What the packed backward needs: the inputs, the output, its log-sum-exp, where the
/// sequences lie and the options.
#[derive(Debug, Clone)]
struct SavedPacked<B: FlashAttentionBackend> {
    tensors: [FloatTensor<B>; 5],
    sequences: PackedStarts<B>,
    options: FlashAttentionOptions,
}

impl<B: FlashAttentionBackend> Backward<B, 3> for PackedNode {
    type State = SavedPacked<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let SavedPacked {
            tensors: [q, k, v, output, lse],
            sequences,
            options,
        } = ops.state;
        let grad_output = grads.consume::<B>(&ops.node);
        let FlashAttentionGrads {
            q: dq,
            k: dk,
            v: dv,
            ..
        } = B::flash_attention_backward_packed(
            q,
            k,
            v,
            sequences,
            output,
            lse,
            grad_output,
            options,
        );
        for (parent, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(parent) = parent {
                grads.register::<B>(parent.id, grad);
            }
        }
    }
}

/// The inner backend's packing (integer tensors carry no graph: the inner backend's are the
/// same).
fn inner_starts<B: FlashAttentionBackend, C: CheckpointStrategy>(
    sequences: PackedStarts<Autodiff<B, C>>,
) -> PackedStarts<B> {
    PackedStarts {
        starts: sequences.starts,
        max_query: sequences.max_query,
        max_key: sequences.max_key,
    }
}

/// The inner backend's score inputs (a mask has no gradient; the bias's node is kept apart).
fn inner<B: FlashAttentionBackend, C: CheckpointStrategy>(
    inputs: ScoreInputs<Autodiff<B, C>>,
) -> ScoreInputs<B> {
    let (mask, bias) = inputs.into_parts();
    ScoreInputs::new(mask, bias.map(|bias| bias.into_primitive()))
}

impl<B: FlashAttentionBackend, C: CheckpointStrategy> FlashAttentionBackend for Autodiff<B, C> {
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        inputs: ScoreInputs<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionForward<Self> {
        let bias_node = inputs.bias().map(|bias| bias.node());
        let inputs = inner(inputs);
        let (q, q_node) = q.into_parts();
        let (k, k_node) = k.into_parts();
        let (v, v_node) = v.into_parts();
        let forward =
            B::flash_attention_forward(q.clone(), k.clone(), v.clone(), inputs.clone(), options);
        // The log-sum-exp is an output without a gradient of its own.
        let lse = <Self as AutodiffBackend>::from_inner(forward.lse.clone());
        let state = || Saved {
            tensors: [q, k, v, forward.output.clone(), forward.lse],
            inputs,
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
        let output = match bias_node {
            Some(bias_node) => record!(4, [q_node, k_node, v_node, bias_node]),
            None => record!(3, [q_node, k_node, v_node]),
        };
        FlashAttentionForward { output, lse }
    }

    /// The inner backend's output, untracked: the forward over a cache is for inference.
    fn flash_attention_forward_cached(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        keys: KeyCache<Self>,
        options: FlashAttentionOptions,
    ) -> FloatTensor<Self> {
        // Integer tensors carry no graph: the inner backend's are the same.
        let keys = match keys {
            KeyCache::Lengths(lengths) => KeyCache::Lengths(lengths),
            KeyCache::Paged(lengths, table) => KeyCache::Paged(lengths, table),
        };
        let output = B::flash_attention_forward_cached(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            keys,
            options,
        );
        <Self as AutodiffBackend>::from_inner(output)
    }

    fn flash_attention_forward_packed(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        sequences: PackedStarts<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionForward<Self> {
        let sequences = inner_starts(sequences);
        let (q, q_node) = q.into_parts();
        let (k, k_node) = k.into_parts();
        let (v, v_node) = v.into_parts();
        let forward = B::flash_attention_forward_packed(
            q.clone(),
            k.clone(),
            v.clone(),
            sequences.clone(),
            options,
        );
        let lse = <Self as AutodiffBackend>::from_inner(forward.lse.clone());
        let output = match PackedNode
            .prepare::<C>([q_node, k_node, v_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                SavedPacked {
                    tensors: [q, k, v, forward.output.clone(), forward.lse],
                    sequences,
                    options,
                },
                forward.output,
            ),
            OpsKind::UnTracked(prep) => prep.finish(forward.output),
        };
        FlashAttentionForward { output, lse }
    }

    /// The gradients of the inner backend, as untracked tensors (no second-order graph).
    #[allow(clippy::too_many_arguments)]
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
        let grads = B::flash_attention_backward_packed(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            inner_starts(sequences),
            output.into_primitive(),
            lse.into_primitive(),
            grad_output.into_primitive(),
            options,
        );
        let untracked = <Self as AutodiffBackend>::from_inner;
        FlashAttentionGrads {
            q: untracked(grads.q),
            k: untracked(grads.k),
            v: untracked(grads.v),
            bias: BiasGrad::Absent,
        }
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
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            inner(inputs),
            output.into_primitive(),
            lse.into_primitive(),
            grad_output.into_primitive(),
            options,
            bias_grad,
        );
        let untracked = <Self as AutodiffBackend>::from_inner;
        FlashAttentionGrads {
            q: untracked(grads.q),
            k: untracked(grads.k),
            v: untracked(grads.v),
            bias: match grads.bias {
                BiasGrad::Absent => BiasGrad::Absent,
                BiasGrad::Present(grad) => BiasGrad::Present(untracked(grad)),
            },
        }
    }
}
