//! [`FlashAttentionBackend`] for `Fusion<B>`: the forward and the backward are each registered
//! as one custom operation in the fusion stream, which runs the inner backend's fused kernels
//! when the stream executes.

use core::marker::PhantomData;

use burn::backend::TensorMetadata;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_fusion::custom::{
    CustomOpIr, HandleContainer, Operation, OperationIr, StreamId, TensorIr,
};
use burn_fusion::{ExecutionError, Fusion, FusionBackend, FusionRuntime};

use crate::backend::{
    BiasGrad, FlashAttentionBackend, FlashAttentionForward, FlashAttentionGrads, KeyCache,
    PackedStarts, ScoreInputs,
};
use crate::options::FlashAttentionOptions;

/// Names of the custom operations in the fusion stream.
const FORWARD_OP: &str = "burn_flash::flash_attention_forward";
const BACKWARD_OP: &str = "burn_flash::flash_attention_backward";
const CACHED_OP: &str = "burn_flash::flash_attention_forward_cached";
const PACKED_OP: &str = "burn_flash::flash_attention_forward_packed";
const PACKED_BACKWARD_OP: &str = "burn_flash::flash_attention_backward_packed";

/// Which per-score inputs follow `q`, `k`, `v` (and, in the backward, the output, the
/// log-sum-exp and its gradient) in a custom operation's inputs: the mask, then the bias.
#[derive(Debug, Clone, Copy)]
struct Extra {
    mask: bool,
    bias: bool,
}

impl Extra {
    /// Which inputs there are, and their IR in order.
    fn of<B: FusionBackend>(inputs: ScoreInputs<Fusion<B>>) -> (Self, Vec<TensorIr>) {
        let (mask, bias) = inputs.into_parts();
        let extra = Self {
            mask: mask.is_some(),
            bias: bias.is_some(),
        };
        let irs = mask
            .map(|mask| mask.into_ir())
            .into_iter()
            .chain(bias.map(|bias| bias.into_ir()))
            .collect();
        (extra, irs)
    }

    /// The inner backend's tensors of the inputs described from `irs`.
    fn resolve<B: FusionBackend>(
        self,
        irs: &[TensorIr],
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) -> ScoreInputs<B> {
        let mut irs = irs.iter();
        let mask = self
            .mask
            .then(|| handles.get_bool_tensor::<B>(irs.next().expect("mask input")));
        let bias = self
            .bias
            .then(|| handles.get_float_tensor::<B>(irs.next().expect("bias input")));
        ScoreInputs::new(mask, bias)
    }
}

/// The lazy forward: inputs `[q, k, v, mask?, bias?]`, outputs `[output, lse]`.
#[derive(Debug)]
struct ForwardOp<B> {
    desc: CustomOpIr,
    extra: Extra,
    options: FlashAttentionOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashAttentionBackend> Operation<B::FusionRuntime> for ForwardOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) -> Result<(), ExecutionError> {
        let (inputs, outputs) = (&self.desc.inputs, &self.desc.outputs);
        let extra = self.extra.resolve::<B>(&inputs[3..], handles);
        let forward = B::flash_attention_forward(
            handles.get_float_tensor::<B>(&inputs[0]),
            handles.get_float_tensor::<B>(&inputs[1]),
            handles.get_float_tensor::<B>(&inputs[2]),
            extra,
            self.options,
        );
        handles.register_float_tensor::<B>(&outputs[0].id, forward.output);
        handles.register_float_tensor::<B>(&outputs[1].id, forward.lse);
        Ok(())
    }
}

/// The lazy forward over a cache: inputs `[q, k, v, lengths, block_table?]`, output
/// `[output]`.
#[derive(Debug)]
struct CachedOp<B> {
    desc: CustomOpIr,
    options: FlashAttentionOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashAttentionBackend> Operation<B::FusionRuntime> for CachedOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) -> Result<(), ExecutionError> {
        let (inputs, outputs) = (&self.desc.inputs, &self.desc.outputs);
        let lengths = handles.get_int_tensor::<B>(&inputs[3]);
        let keys = match inputs.get(4) {
            Some(table) => KeyCache::Paged(lengths, handles.get_int_tensor::<B>(table)),
            None => KeyCache::Lengths(lengths),
        };
        let output = B::flash_attention_forward_cached(
            handles.get_float_tensor::<B>(&inputs[0]),
            handles.get_float_tensor::<B>(&inputs[1]),
            handles.get_float_tensor::<B>(&inputs[2]),
            keys,
            self.options,
        );
        handles.register_float_tensor::<B>(&outputs[0].id, output);
        Ok(())
    }
}

/// The lazy forward over packed sequences: inputs `[q, k, v, starts]`, outputs `[output,
/// lse]`.
#[derive(Debug)]
struct PackedOp<B> {
    desc: CustomOpIr,
    /// The longest sequence's queries and keys.
    longest: (usize, usize),
    options: FlashAttentionOptions,
    _backend: PhantomData<B>,
}

/// The starts of a packed op whose inputs hold them at `at`.
fn packed_starts<B: FusionBackend>(
    inputs: &[TensorIr],
    at: usize,
    (max_query, max_key): (usize, usize),
    handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
) -> PackedStarts<B> {
    PackedStarts {
        starts: handles.get_int_tensor::<B>(&inputs[at]),
        max_query,
        max_key,
    }
}

impl<B: FusionBackend + FlashAttentionBackend> Operation<B::FusionRuntime> for PackedOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) -> Result<(), ExecutionError> {
        let (inputs, outputs) = (&self.desc.inputs, &self.desc.outputs);
        let sequences = packed_starts::<B>(inputs, 3, self.longest, handles);
        let mut tensor = |at: usize| handles.get_float_tensor::<B>(&inputs[at]);
        let [q, k, v] = [0, 1, 2].map(&mut tensor);
        let forward = B::flash_attention_forward_packed(q, k, v, sequences, self.options);
        handles.register_float_tensor::<B>(&outputs[0].id, forward.output);
        handles.register_float_tensor::<B>(&outputs[1].id, forward.lse);
        Ok(())
    }
}

/// The lazy backward over packed sequences: inputs `[q, k, v, output, lse, grad_output,
/// starts]`, outputs `[dq, dk, dv]`.
#[derive(Debug)]
struct PackedBackwardOp<B> {
    desc: CustomOpIr,
    longest: (usize, usize),
    options: FlashAttentionOptions,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashAttentionBackend> Operation<B::FusionRuntime> for PackedBackwardOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) -> Result<(), ExecutionError> {
        let (inputs, outputs) = (&self.desc.inputs, &self.desc.outputs);
        let sequences = packed_starts::<B>(inputs, 6, self.longest, handles);
        let mut tensor = |at: usize| handles.get_float_tensor::<B>(&inputs[at]);
        let [q, k, v, output, lse, grad] = [0, 1, 2, 3, 4, 5].map(&mut tensor);
        let grads =
            B::flash_attention_backward_packed(q, k, v, sequences, output, lse, grad, self.options);
        handles.register_float_tensor::<B>(&outputs[0].id, grads.q);
        handles.register_float_tensor::<B>(&outputs[1].id, grads.k);
        handles.register_float_tensor::<B>(&outputs[2].id, grads.v);
        Ok(())
    }
}

/// The lazy backward: inputs `[q, k, v, output, lse, grad_output, mask?, bias?]`, outputs
/// `[dq, dk, dv, dbias?]`.
#[derive(Debug)]
struct BackwardOp<B> {
    desc: CustomOpIr,
    extra: Extra,
    options: FlashAttentionOptions,
    bias_grad: bool,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashAttentionBackend> Operation<B::FusionRuntime> for BackwardOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) -> Result<(), ExecutionError> {
        let (inputs, outputs) = (&self.desc.inputs, &self.desc.outputs);
        let extra = self.extra.resolve::<B>(&inputs[6..], handles);
        let mut tensor = |at: usize| handles.get_float_tensor::<B>(&inputs[at]);
        let [q, k, v, output, lse, grad] = [0, 1, 2, 3, 4, 5].map(&mut tensor);
        let grads = B::flash_attention_backward(
            q,
            k,
            v,
            extra,
            output,
            lse,
            grad,
            self.options,
            self.bias_grad,
        );
        handles.register_float_tensor::<B>(&outputs[0].id, grads.q);
        handles.register_float_tensor::<B>(&outputs[1].id, grads.k);
        handles.register_float_tensor::<B>(&outputs[2].id, grads.v);
        if let (Some(ir), Some(grad)) = (outputs.get(3), grads.bias.into_option()) {
            handles.register_float_tensor::<B>(&ir.id, grad);
        }
        Ok(())
    }
}

impl<B: FusionBackend + FlashAttentionBackend> FlashAttentionBackend for Fusion<B> {
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        inputs: ScoreInputs<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionForward<Self> {
        let client = q.client.clone();
        let [batch, heads, seq_q, _] = q.shape().dims::<4>();
        let value_dim = v.shape()[3];
        let output = TensorIr::uninit(
            client.create_empty_handle(),
            Shape::new([batch, heads, seq_q, value_dim]),
            q.dtype,
        );
        let lse = TensorIr::uninit(
            client.create_empty_handle(),
            Shape::new([batch, heads, seq_q]),
            DType::F32,
        );
        let (extra, extra_irs) = Extra::of(inputs);
        let mut irs = vec![q.into_ir(), k.into_ir(), v.into_ir()];
        irs.extend(extra_irs);
        let desc = CustomOpIr::new(FORWARD_OP, &irs, &[output, lse]);
        let op = ForwardOp::<B> {
            desc: desc.clone(),
            extra,
            options,
            _backend: PhantomData,
        };
        let mut outputs = client
            .register(StreamId::current(), OperationIr::Custom(desc), op)
            .into_iter();
        let (Some(output), Some(lse), None) = (outputs.next(), outputs.next(), outputs.next())
        else {
            unreachable!("the forward registers two outputs");
        };
        FlashAttentionForward { output, lse }
    }

    fn flash_attention_forward_cached(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        keys: KeyCache<Self>,
        options: FlashAttentionOptions,
    ) -> FloatTensor<Self> {
        let client = q.client.clone();
        let [batch, heads, seq_q, _] = q.shape().dims::<4>();
        let output = TensorIr::uninit(
            client.create_empty_handle(),
            Shape::new([batch, heads, seq_q, v.shape()[3]]),
            q.dtype,
        );
        let mut irs = vec![q.into_ir(), k.into_ir(), v.into_ir()];
        match keys {
            KeyCache::Lengths(lengths) => irs.push(lengths.into_ir()),
            KeyCache::Paged(lengths, table) => irs.extend([lengths.into_ir(), table.into_ir()]),
        }
        let desc = CustomOpIr::new(CACHED_OP, &irs, &[output]);
        let op = CachedOp::<B> {
            desc: desc.clone(),
            options,
            _backend: PhantomData,
        };
        let mut outputs = client
            .register(StreamId::current(), OperationIr::Custom(desc), op)
            .into_iter();
        let (Some(output), None) = (outputs.next(), outputs.next()) else {
            unreachable!("the forward over a cache registers one output");
        };
        output
    }

    fn flash_attention_forward_packed(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        sequences: PackedStarts<Self>,
        options: FlashAttentionOptions,
    ) -> FlashAttentionForward<Self> {
        let client = q.client.clone();
        let [_, heads, total_q, _] = q.shape().dims::<4>();
        let output = TensorIr::uninit(
            client.create_empty_handle(),
            Shape::new([1, heads, total_q, v.shape()[3]]),
            q.dtype,
        );
        let lse = TensorIr::uninit(
            client.create_empty_handle(),
            Shape::new([1, heads, total_q]),
            DType::F32,
        );
        let irs = [
            q.into_ir(),
            k.into_ir(),
            v.into_ir(),
            sequences.starts.into_ir(),
        ];
        let desc = CustomOpIr::new(PACKED_OP, &irs, &[output, lse]);
        let op = PackedOp::<B> {
            desc: desc.clone(),
            longest: (sequences.max_query, sequences.max_key),
            options,
            _backend: PhantomData,
        };
        let mut outputs = client
            .register(StreamId::current(), OperationIr::Custom(desc), op)
            .into_iter();
        let (Some(output), Some(lse), None) = (outputs.next(), outputs.next(), outputs.next())
        else {
            unreachable!("the packed forward registers two outputs");
        };
        FlashAttentionForward { output, lse }
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
        let client = q.client.clone();
        // Contiguous gradients of the inputs' shapes.
        let like = |t: &FloatTensor<Self>| {
            TensorIr::uninit(client.create_empty_handle(), t.shape(), t.dtype)
        };
        let outputs = [like(&q), like(&k), like(&v)];
        let irs = [
            q.into_ir(),
            k.into_ir(),
            v.into_ir(),
            output.into_ir(),
            lse.into_ir(),
            grad_output.into_ir(),
            sequences.starts.into_ir(),
        ];
        let desc = CustomOpIr::new(PACKED_BACKWARD_OP, &irs, &outputs);
        let op = PackedBackwardOp::<B> {
            desc: desc.clone(),
            longest: (sequences.max_query, sequences.max_key),
            options,
            _backend: PhantomData,
        };
        let mut grads = client
            .register(StreamId::current(), OperationIr::Custom(desc), op)
            .into_iter();
        let (Some(q), Some(k), Some(v), None) =
            (grads.next(), grads.next(), grads.next(), grads.next())
        else {
            unreachable!("the packed backward registers dq, dk and dv");
        };
        FlashAttentionGrads {
            q,
            k,
            v,
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
        let client = q.client.clone();
        let like = |t: &FloatTensor<Self>| {
            TensorIr::uninit(client.create_empty_handle(), t.shape(), t.dtype)
        };
        let mut outputs = vec![like(&q), like(&k), like(&v)];
        let bias_grad = bias_grad && inputs.bias().is_some();
        if let Some(bias) = inputs.bias().filter(|_| bias_grad) {
            outputs.push(like(bias));
        }
        let (extra, extra_irs) = Extra::of(inputs);
        let mut irs = vec![
            q.into_ir(),
            k.into_ir(),
            v.into_ir(),
            output.into_ir(),
            lse.into_ir(),
            grad_output.into_ir(),
        ];
        irs.extend(extra_irs);
        let desc = CustomOpIr::new(BACKWARD_OP, &irs, &outputs);
        let op = BackwardOp::<B> {
            desc: desc.clone(),
            extra,
            options,
            bias_grad,
            _backend: PhantomData,
        };
        let mut grads = client
            .register(StreamId::current(), OperationIr::Custom(desc), op)
            .into_iter();
        let (Some(q), Some(k), Some(v)) = (grads.next(), grads.next(), grads.next()) else {
            unreachable!("the backward registers dq, dk and dv");
        };
        FlashAttentionGrads {
            q,
            k,
            v,
            bias: grads.next().map_or(BiasGrad::Absent, BiasGrad::Present),
        }
    }
}
