//! What a device offers the kernels, read once from its client into a plain value, so that the
//! launch plans ([`forward::plan`](super::forward::plan), [`backward::plan`](super::backward::plan))
//! decide on the host and are unit-tested without a device.

use cubecl::features::{MmaConfig, Plane, Tma};
use cubecl::ir::features::AtomicUsage;
use cubecl::ir::{ElemType, Type};
use cubecl::prelude::*;

use super::config::TilePath;
use super::tensors::{BF16, F16, F32};

/// Largest head dim the portable tile unrolls (its query and output rows live in registers).
const PORTABLE_MAX_DIM: usize = 256;

/// Head dims of queries/keys and of values the tensor-core tile is built for: its score product
/// takes 32 columns per step of its loop, and its blocks are tuned per head dim.
pub const TENSOR_CORE_DIMS: [usize; 5] = [32, 64, 96, 128, 256];

/// The smallest head dim of the tensor-core tile that holds `dim` columns, if any.
pub fn tensor_core_dim(dim: usize) -> Option<usize> {
    TENSOR_CORE_DIMS
        .into_iter()
        .find(|&tile_dim| tile_dim >= dim)
}

/// The device's features that decide a launch, for one input dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceCaps {
    /// The runtime stores the dtype.
    pub stores_dtype: bool,
    /// `mma.sync` m16n8k16 for the dtype with f32 accumulation, `ldmatrix`, asynchronous
    /// copies and planes of exactly 32 lanes.
    pub tensor_cores: bool,
    /// Shared memory one cube may use, in bytes.
    pub shared_memory: usize,
    /// Tensor maps and the copy engine behind them (CUDA from SM90).
    pub tma: bool,
    /// Warpgroup MMA (`wgmma`, SM90 only). CubeCL 0.12 reports no compute capability: it
    /// registers tensor maps from SM90 and wide im2col maps from SM100, which has no `wgmma`,
    /// so the first without the second is SM90.
    pub wgmma: bool,
    /// f32 atomic adds of 1, 2 and 4 lanes at once.
    pub atomic_add_f32: [bool; 3],
    /// Streaming multiprocessors, where the runtime tells.
    pub sms: Option<usize>,
    /// Largest cube count per grid dimension.
    pub max_cube_count: (u32, u32, u32),
}

impl DeviceCaps {
    /// The features of `client`'s device for inputs of `dtype`.
    pub fn of(client: &Client, dtype: ElemType) -> Self {
        Self::from_properties(client.properties(), dtype)
    }

    /// The features of a device with these properties for inputs of `dtype`.
    pub fn from_properties(props: &DeviceProperties, dtype: ElemType) -> Self {
        let features = &props.features;
        let elem = dtype;
        let mma = MmaConfig {
            a_type: elem,
            b_type: elem,
            cd_type: F32,
            m: 16,
            n: 8,
            k: 16,
        };
        let adds = |width: usize| {
            let ty = Type::atomic(Type::new(F32).with_vector_size(width));
            props.atomic_type_usage(ty).contains(AtomicUsage::Add)
        };
        Self {
            stores_dtype: features.types.elem.contains_key(&elem),
            tensor_cores: features.matmul.mma.contains(&mma)
                && features.matmul.ldmatrix.contains(&elem)
                && features.copy_async
                && features.plane.contains(Plane::Ops)
                && props.hardware.plane_size_min == 32
                && props.hardware.plane_size_max == 32,
            shared_memory: props.hardware.max_shared_memory_size,
            tma: features.tma.contains(Tma::Base),
            wgmma: features.tma.contains(Tma::Base) && !features.tma.contains(Tma::Im2colWide),
            atomic_add_f32: [adds(1), adds(2), adds(4)],
            sms: props
                .hardware
                .num_streaming_multiprocessors
                .map(|n| n as usize),
            max_cube_count: props.hardware.max_cube_count,
        }
    }

    /// Whether f32 atomic adds of `width` lanes (1, 2 or 4) run on this device.
    pub fn adds_f32(&self, width: usize) -> bool {
        match width {
            1 => self.atomic_add_f32[0],
            2 => self.atomic_add_f32[1],
            4 => self.atomic_add_f32[2],
            _ => false,
        }
    }

    /// `Err` when a `kernel` launch needing `bytes` of shared memory per cube does not fit.
    pub fn fits_shared(&self, kernel: &str, bytes: usize) -> Result<(), String> {
        if bytes > self.shared_memory {
            return Err(format!(
                "the {kernel} kernel needs {bytes} bytes of shared memory, the device has {}",
                self.shared_memory
            ));
        }
        Ok(())
    }

    /// Cubes of a tensor-core launch an SM holds with `bytes` of shared memory and `units`
    /// units each: an SM has 1 KiB more than one cube may use and reserves 1 KiB per cube, and
    /// at up to 255 registers a unit its 64K registers hold `65536 / (255 · units)` cubes (two
    /// of 128 units, eight of 32).
    pub fn cubes_per_sm(&self, bytes: usize, units: usize) -> usize {
        let by_registers = (65536 / (255 * units.max(1))).max(1);
        ((self.shared_memory + 1024) / (bytes + 1024)).min(by_registers)
    }

    /// The tile for this dtype and head dims, shared memory not yet checked: tensor cores where
    /// the device has them for the dtype (f16, bf16) and the head dims are ones the tile is
    /// built for; else the portable tile. `Err` says why neither runs.
    pub fn tile(
        &self,
        dtype: ElemType,
        head_dim: usize,
        value_dim: usize,
    ) -> Result<TilePath, String> {
        if ![F16, BF16, F32].contains(&dtype) {
            return Err(format!("dtype {dtype:?} is not f16, bf16 or f32"));
        }
        if !self.stores_dtype {
            return Err(format!("dtype {dtype:?} is not supported by this runtime"));
        }
        if dtype != F32 && self.tensor_cores {
            if !TENSOR_CORE_DIMS.contains(&head_dim) || !TENSOR_CORE_DIMS.contains(&value_dim) {
                return Err(format!(
                    "the tensor-core kernel supports head dims {TENSOR_CORE_DIMS:?} (q/k {head_dim}, v {value_dim})"
                ));
            }
            return Ok(TilePath::TensorCore);
        }
        if head_dim == 0
            || value_dim == 0
            || head_dim > PORTABLE_MAX_DIM
            || value_dim > PORTABLE_MAX_DIM
        {
            return Err(format!(
                "the portable kernel supports head dims 1..={PORTABLE_MAX_DIM} (q/k {head_dim}, v {value_dim})"
            ));
        }
        Ok(TilePath::Portable)
    }
}

#[cfg(test)]
pub mod caps {
    //! Devices for the plans' unit tests, as their runtimes report them.
    use super::DeviceCaps;

    /// An H100 (SM90) on CUDA.
    pub fn h100() -> DeviceCaps {
        DeviceCaps {
            stores_dtype: true,
            tensor_cores: true,
            shared_memory: 227 * 1024,
            tma: true,
            wgmma: true,
            atomic_add_f32: [true, true, true],
            sms: Some(132),
            max_cube_count: (u32::MAX, 65535, 65535),
        }
    }

    /// An A100 (SM80) on CUDA: no tensor maps, no vector atomics, 163 KiB per cube.
    pub fn a100() -> DeviceCaps {
        DeviceCaps {
            shared_memory: 163 * 1024,
            tma: false,
            wgmma: false,
            atomic_add_f32: [true, false, false],
            sms: Some(108),
            ..h100()
        }
    }

    /// lavapipe through wgpu: no tensor cores, 32 KiB of shared memory.
    pub fn lavapipe() -> DeviceCaps {
        DeviceCaps {
            stores_dtype: true,
            tensor_cores: false,
            shared_memory: 32 * 1024,
            tma: false,
            wgmma: false,
            atomic_add_f32: [true, false, false],
            sms: None,
            max_cube_count: (65535, 65535, 65535),
        }
    }
}
