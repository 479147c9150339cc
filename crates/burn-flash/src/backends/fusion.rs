//! [`FlashAttentionBackend`] for `Fusion<B>`: the forward and the backward are each registered
//! as one custom operation in the fusion stream, which runs the inner backend's fused kernels
//! when the stream executes.

use core::marker::PhantomData;

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use crate::backend::{
    FlashAttentionBackend, FlashAttentionForward, FlashAttentionGrads, FlashAttentionProblem,
};
use crate::{FlashAttentionOptions, TilePath};

/// Names of the custom operations in the fusion stream.
const FORWARD_OP: &str = "burn_flash::flash_attention_forward";
const BACKWARD_OP: &str = "burn_flash::flash_attention_backward";

/// The lazy forward: inputs `[q, k, v]`, outputs `[output, lse]`.
#[derive(Debug)]
struct ForwardOp<B> {
    desc: CustomOpIr,
    options: FlashAttentionOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashAttentionBackend> Operation<B::FusionRuntime> for ForwardOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let ([q, k, v], [output, lse]) = self.desc.as_fixed();
        let forward = B::flash_attention_forward(
            handles.get_float_tensor::<B>(q),
            handles.get_float_tensor::<B>(k),
            handles.get_float_tensor::<B>(v),
            self.options,
        );
        handles.register_float_tensor::<B>(&output.id, forward.output);
        handles.register_float_tensor::<B>(&lse.id, forward.lse);
    }
}

/// The lazy backward: inputs `[q, k, v, output, lse, grad_output]`, outputs `[dq, dk, dv]`.
#[derive(Debug)]
struct BackwardOp<B> {
    desc: CustomOpIr,
    options: FlashAttentionOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashAttentionBackend> Operation<B::FusionRuntime> for BackwardOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let ([q, k, v, output, lse, grad], [dq, dk, dv]) = self.desc.as_fixed();
        let grads = B::flash_attention_backward(
            handles.get_float_tensor::<B>(q),
            handles.get_float_tensor::<B>(k),
            handles.get_float_tensor::<B>(v),
            handles.get_float_tensor::<B>(output),
            handles.get_float_tensor::<B>(lse),
            handles.get_float_tensor::<B>(grad),
            self.options,
        );
        handles.register_float_tensor::<B>(&dq.id, grads.q);
        handles.register_float_tensor::<B>(&dk.id, grads.k);
        handles.register_float_tensor::<B>(&dv.id, grads.v);
    }
}

impl<B: FusionBackend + FlashAttentionBackend> FlashAttentionBackend for Fusion<B> {
    /// Fusion shares its device type with the inner backend, which decides.
    fn flash_attention_support(
        device: &B::Device,
        problem: &FlashAttentionProblem,
    ) -> Result<TilePath, String> {
        B::flash_attention_support(device, problem)
    }

    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionForward<Self> {
        let client = q.client.clone();
        let [batch, heads, seq_q, _] = q.shape().dims::<4>();
        let problem = FlashAttentionProblem::new(
            q.shape().dims(),
            k.shape().dims(),
            v.shape().dims(),
            q.dtype,
            options.causal,
        );
        // The operation runs later, when the stream executes: refuse unsupported inputs now,
        // at the caller, not deep inside the stream.
        if let Err(reason) = B::flash_attention_support(client.device(), &problem) {
            panic!("flash attention: the fused forward cannot run these inputs: {reason}");
        }

        let streams = OperationStreams::with_inputs([&q, &k, &v]);
        let output = TensorIr::uninit(
            client.create_empty_handle(),
            Shape::new([batch, heads, seq_q, problem.value_dim]),
            q.dtype,
        );
        let lse = TensorIr::uninit(
            client.create_empty_handle(),
            Shape::new([batch, heads, seq_q]),
            DType::F32,
        );
        let desc = CustomOpIr::new(
            FORWARD_OP,
            &[q.into_ir(), k.into_ir(), v.into_ir()],
            &[output, lse],
        );
        let op = ForwardOp::<B> {
            desc: desc.clone(),
            options,
            _backend: PhantomData,
        };
        let mut outputs = client
            .register(streams, OperationIr::Custom(desc), op)
            .into_iter();
        let (Some(output), Some(lse), None) = (outputs.next(), outputs.next(), outputs.next())
        else {
            unreachable!("the forward registers two outputs");
        };
        FlashAttentionForward { output, lse }
    }

    fn flash_attention_backward_support(
        device: &B::Device,
        problem: &FlashAttentionProblem,
    ) -> Result<(), String> {
        B::flash_attention_backward_support(device, problem)
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
        let client = q.client.clone();
        let streams = OperationStreams::with_inputs([&q, &k, &v, &output, &lse, &grad_output]);
        let like = |t: &FloatTensor<Self>| {
            TensorIr::uninit(client.create_empty_handle(), t.shape(), t.dtype)
        };
        let outputs = [like(&q), like(&k), like(&v)];
        let desc = CustomOpIr::new(
            BACKWARD_OP,
            &[
                q.into_ir(),
                k.into_ir(),
                v.into_ir(),
                output.into_ir(),
                lse.into_ir(),
                grad_output.into_ir(),
            ],
            &outputs,
        );
        let op = BackwardOp::<B> {
            desc: desc.clone(),
            options,
            _backend: PhantomData,
        };
        let mut grads = client
            .register(streams, OperationIr::Custom(desc), op)
            .into_iter();
        let (Some(q), Some(k), Some(v), None) =
            (grads.next(), grads.next(), grads.next(), grads.next())
        else {
            unreachable!("the backward registers three outputs");
        };
        FlashAttentionGrads { q, k, v }
    }
}
