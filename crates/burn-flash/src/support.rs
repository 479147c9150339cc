//! Whether the fused kernels can run a problem on a device, decided up front from the device's
//! properties, without launching anything.

use burn::backend::DispatchDevice;
use burn::tensor::Device;
use burn_backend::cubecl::dtype_to_elem_type;

use crate::backend::FlashAttentionProblem;
use crate::kernel::{self, TilePath};
use crate::options::FlashAttentionOptions;

/// Whether the fused forward can run this problem on this device, and with which matrix tile;
/// `Err` carries the reason it cannot (a backend without the kernels, a dtype, a head dim, a
/// missing device feature). On an autodiff device the fused backward must be able to follow.
///
/// # Example
///
/// ```no_run
/// use burn::tensor::{DType, Device};
/// use burn_flash::{flash_attention_support, FlashAttentionProblem, TilePath};
///
/// let dims = [1, 8, 1024, 64];
/// let problem = FlashAttentionProblem::new(dims, dims, dims, DType::F32, true);
/// let device = Device::wgpu(Default::default());
/// assert_eq!(flash_attention_support(&device, &problem), Ok(TilePath::Portable));
/// ```
pub fn flash_attention_support(
    device: &Device,
    problem: &FlashAttentionProblem,
) -> Result<TilePath, String> {
    support(device.as_dispatch(), problem, false)
}

/// Whether the fused backward can run this problem on this device; `Err` carries the reason.
///
/// # Example
///
/// ```no_run
/// use burn::tensor::{DType, Device};
/// use burn_flash::{flash_attention_backward_support, FlashAttentionProblem};
///
/// let dims = [1, 8, 512, 64];
/// let problem = FlashAttentionProblem::new(dims, dims, dims, DType::F32, true);
/// let device = Device::wgpu(Default::default());
/// assert!(flash_attention_backward_support(&device, &problem).is_ok());
/// ```
pub fn flash_attention_backward_support(
    device: &Device,
    problem: &FlashAttentionProblem,
) -> Result<TilePath, String> {
    support(device.as_dispatch(), problem, true)
}

fn support(
    device: &DispatchDevice,
    problem: &FlashAttentionProblem,
    backward: bool,
) -> Result<TilePath, String> {
    match device {
        DispatchDevice::Cube(device) => {
            let client = device.client();
            let dtype = dtype_to_elem_type(problem.dtype);
            let (head_dim, value_dim) = (problem.head_dim, problem.value_dim);
            let tile = kernel::support(&client, dtype, head_dim, value_dim)?;
            if backward {
                kernel::backward_support(&client, dtype, head_dim, value_dim)?;
            }
            Ok(tile)
        }
        // The fused forward is used under autodiff only where the fused backward can follow it.
        DispatchDevice::Autodiff(device) => support(&device.clone().inner(), problem, true),
        #[allow(unreachable_patterns)]
        other => Err(format!("no fused kernel on the {other:?} backend")),
    }
}

/// Whether the fused forward of this problem (contiguous inputs, no mask or bias input) takes
/// the Hopper forward on this device, on its own or under autodiff.
pub(crate) fn takes_warpgroup(
    device: &DispatchDevice,
    problem: &FlashAttentionProblem,
    options: &FlashAttentionOptions,
) -> bool {
    match device {
        DispatchDevice::Cube(device) => kernel::takes_warpgroup(
            &device.client(),
            dtype_to_elem_type(problem.dtype),
            [
                problem.batch,
                problem.heads,
                problem.seq_q,
                problem.head_dim,
            ],
            [
                problem.batch,
                problem.kv_heads,
                problem.seq_k,
                problem.head_dim,
            ],
            problem.value_dim,
            options,
        ),
        DispatchDevice::Autodiff(device) => {
            takes_warpgroup(&device.clone().inner(), problem, options)
        }
        #[allow(unreachable_patterns)]
        _ => false,
    }
}
