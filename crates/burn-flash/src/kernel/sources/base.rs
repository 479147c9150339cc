//! What the fused kernels' creation without a client shares: the device they are created for,
//! the problem, the kernel with its launch's grid, and placeholder tensors.

use std::fmt::{Debug, Display};
use std::sync::Arc;

use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::zspace::Shape;
use cubecl::zspace::metadata::Metadata;
use cubecl::zspace::striding::row_major_contiguous_strides;
use cubecl_common::device::{DeviceId, ServiceId};
use cubecl_environment::stream::StreamId;

use crate::kernel::config::{ScoreParams, TailPart, TileConfig};
use crate::kernel::tensors::layout_tma_aligned;
use crate::options::FlashAttentionOptions;

/// The device the kernels are created for, as its runtime describes it (what a client of it
/// would hold).
#[derive(Clone)]
pub struct Target {
    /// Its features and limits.
    pub device: Arc<DeviceProperties>,
    /// How its compiler lays out what the kernels use.
    pub target: Arc<TargetProperties>,
}

/// The attention the kernels are planned for: `[batch, heads, seq, head_dim]` queries, keys,
/// values and output of `dtype`, contiguous, without mask or bias inputs.
#[derive(Clone, Copy, Debug)]
pub struct Problem {
    /// The inputs' dtype.
    pub dtype: ElemType,
    /// Sequences.
    pub batch: usize,
    /// Heads of queries, keys and values alike.
    pub heads: usize,
    /// Queries and keys per sequence.
    pub seq: usize,
    /// Width of queries, keys and values.
    pub head_dim: usize,
    /// The call's options; `deterministic` decides how the backward sums dQ.
    pub options: FlashAttentionOptions,
}

impl Problem {
    /// The kernels' view of the options, as the backends form it.
    pub(crate) fn params(&self) -> ScoreParams {
        ScoreParams::new(&self.options, self.heads, self.head_dim, self.seq, self.seq)
    }
}

/// One launch of a kernel, as planned.
pub struct PlannedKernel {
    /// The kernel function (`flash_forward`, `key_value_grads`, `query_grads`).
    pub name: &'static str,
    /// The part of a split dK/dV grid this launch takes (`whole`, `pieces`), if split.
    pub part: Option<&'static str>,
    /// The pass's plan, as the launch logs it.
    pub plan: String,
    /// The comptime configuration the kernel specialises on (`Debug`, pretty).
    pub config: String,
    /// The grid.
    pub cube_count: CubeCount,
    /// The units of a cube.
    pub cube_dim: CubeDim,
    /// The kernel, to define and compile.
    pub kernel: Box<dyn CubeKernel>,
}

impl PlannedKernel {
    /// The launch of `kernel` (created by `create_dummy_kernel` from `name`) with `cfg`, of a
    /// pass planned as `plan`.
    pub(crate) fn new(
        name: &'static str,
        plan: &impl Display,
        cfg: &TileConfig,
        cube_count: CubeCount,
        cube_dim: CubeDim,
        kernel: impl CubeKernel,
    ) -> Self {
        Self {
            part: match cfg.tail {
                TailPart::All => None,
                TailPart::Whole => Some("whole"),
                TailPart::Pieces => Some("pieces"),
            },
            ..Self::of(name, plan, cfg, cube_count, cube_dim, kernel)
        }
    }

    /// [`new`](Self::new) for a kernel of another configuration type, whose grid is whole.
    pub(crate) fn of(
        name: &'static str,
        plan: &impl Display,
        config: &impl Debug,
        cube_count: CubeCount,
        cube_dim: CubeDim,
        kernel: impl CubeKernel,
    ) -> Self {
        Self {
            name,
            part: None,
            plan: plan.to_string(),
            config: format!("{config:#?}"),
            cube_count,
            cube_dim,
            kernel: Box::new(Unchecked(kernel)),
        }
    }
}

/// A kernel from `create_dummy_kernel`, which registers the arguments as a checked launch does,
/// defined as `launch_unchecked` enqueues it: the execution mode only enters when it is compiled
/// (bounds checks) and in its id (the hash its entry point's name ends in).
struct Unchecked<K>(K);

impl<K: CubeKernel> KernelMetadata for Unchecked<K> {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    fn id(&self) -> KernelId {
        self.0.id().mode(ExecutionMode::Unchecked)
    }

    fn address_type(&self) -> ElemType {
        self.0.address_type()
    }
}

impl<K: CubeKernel> CubeKernel for Unchecked<K> {
    fn define(&self) -> KernelDefinition {
        let mut definition = self.0.define();
        let settings = &mut definition.settings;
        let base = match settings.kernel_name.rsplit_once('_') {
            Some((base, _hash)) => base.to_string(),
            None => settings.kernel_name.clone(),
        };
        settings.kernel_name = self.id().entrypoint_name(&base);
        settings.execution_mode = ExecutionMode::Unchecked;
        definition
    }
}

/// A contiguous tensor of a launch that never runs: its layout and dtype, over a buffer nothing
/// backs.
pub(crate) struct Placeholder {
    /// Shape and (contiguous) strides.
    pub meta: Metadata,
    /// The element type.
    pub dtype: ElemType,
}

impl Placeholder {
    /// A contiguous tensor of this shape.
    pub fn new(shape: impl Into<Shape>, dtype: ElemType) -> Self {
        let shape: Shape = shape.into();
        let strides = row_major_contiguous_strides(&shape);
        Self {
            meta: Metadata::new(shape, strides),
            dtype,
        }
    }

    /// The kernel argument of this tensor, over a new handle of its size that no memory backs.
    pub fn arg(&self) -> TensorArg {
        let bytes = self.meta.num_elements() * self.dtype.size();
        let service = ServiceId::of::<Self>(DeviceId::new(0, 0));
        let handle = Handle::new(service, StreamId { value: 0 }, bytes as u64);
        // SAFETY: shape and strides are those of a contiguous tensor of the handle's size, and
        // the kernel is only compiled, never launched.
        unsafe {
            TensorArg::from_raw_parts(
                handle,
                self.meta.strides().clone(),
                self.meta.shape().clone(),
            )
        }
    }

    /// Whether a tensor map can read it ([`layout_tma_aligned`]; buffers start aligned).
    pub fn tma_aligned(&self) -> bool {
        layout_tma_aligned(0, self.meta.strides(), self.dtype.size())
    }

    /// The address width every index into `tensors` fits, as
    /// [`address_type`](super::tensors::address_type) finds it.
    pub fn address_type(tensors: &[&Self]) -> AddressType {
        tensors
            .iter()
            .map(|t| AddressType::from_len(t.meta.num_elements()))
            .max()
            .unwrap_or_default()
    }
}
