//! [`FlashAttentionBackend`] for `Fusion<B>`: the forward is registered as one custom operation
//! in the fusion stream, which runs the inner backend's fused kernel when the stream executes.

use core::marker::PhantomData;

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use crate::backend::{FlashAttentionBackend, FlashAttentionForward, FlashAttentionProblem};
use crate::{FlashAttentionOptions, TilePath};

/// Name of the custom operation in the fusion stream.
const FORWARD_OP: &str = "burn_flash::flash_attention_forward";

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
}
