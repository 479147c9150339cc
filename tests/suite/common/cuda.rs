//! CUDA-only helpers of the integration tests.

use std::io::Write;
use std::sync::OnceLock;

use burn::backend::DispatchDevice;
use burn::backend::cubecl::dtype_to_elem_type;
use burn::tensor::{DType, Device, DeviceType, Tensor};
use cubecl::features::{MmaConfig, Tma};

/// The first CUDA device, once per process, or why there is none.
///
/// `Device::enumerate(DeviceType::Cuda)` asks CubeCL's CUDA runtime for its devices without
/// panicking: it finds none when the driver library (`libcuda`) cannot be loaded or the driver
/// reports no device. A listed device must then answer a first operation.
fn probe() -> Result<Device, String> {
    static PROBE: OnceLock<Result<Device, String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            let device = Device::enumerate(DeviceType::Cuda)
                .into_vec()
                .into_iter()
                .next()
                .ok_or_else(|| {
                    "Device::enumerate(DeviceType::Cuda) lists none: the CUDA driver library \
                     cannot be loaded or reports no device"
                        .to_string()
                })?;
            let x = Tensor::<1>::from_floats([1.0, 2.0, 3.0], &device);
            match x.sum().try_into_data() {
                Ok(data) => match data.iter::<f64>().next() {
                    Some(6.0) => Ok(device),
                    sum => Err(format!(
                        "a first operation on {device:?} returned {sum:?}, not 6"
                    )),
                },
                Err(error) => Err(format!("a first operation on {device:?} failed: {error:?}")),
            }
        })
        .clone()
}

/// The CUDA device, or `None` (with a `skipping: ...` line on stderr) when there is none; panics
/// instead when `BURN_FLASH_REQUIRE_CUDA` is set.
pub fn cuda_device(test: &str) -> Option<Device> {
    match probe() {
        Ok(device) => Some(device),
        Err(reason) => {
            if std::env::var_os("BURN_FLASH_REQUIRE_CUDA").is_some() {
                panic!(
                    "{test}: BURN_FLASH_REQUIRE_CUDA is set but there is no CUDA device: {reason}"
                );
            }
            // Written to the process's stderr directly, so the line shows even when the test
            // harness captures output.
            let _ = writeln!(
                std::io::stderr(),
                "{test}: skipping: no CUDA device ({reason})"
            );
            None
        }
    }
}

/// Whether this device has what the tensor-core tile needs for `dtype` (m16n8k16 MMA with f32
/// accumulation, asynchronous copies: SM80 and newer), read from the features CubeCL's runtime
/// reports for it. On such a device, bf16/f16 with head dims 32, 64, 96, 128 or 256 must run on
/// the tensor cores.
pub fn has_tensor_cores(device: &Device, dtype: DType) -> bool {
    let (elem, f32_elem) = (dtype_to_elem_type(dtype), dtype_to_elem_type(DType::F32));
    match device.clone().without_autodiff().as_dispatch() {
        DispatchDevice::Cube(cube) => {
            let client = cube.client();
            let features = &client.properties().features;
            let mma = MmaConfig {
                a_type: elem,
                b_type: elem,
                cd_type: f32_elem,
                m: 16,
                n: 8,
                k: 16,
            };
            let mma = features.matmul.mma.contains(&mma);
            mma && features.copy_async
        }
        #[allow(unreachable_patterns)]
        other => panic!("not a CubeCL device: {other:?}"),
    }
}

/// Whether this device has Hopper's warpgroup products (`wgmma`: SM90), by which the forward
/// runs where it leads the tensor-core tile: tensor maps without the wide im2col maps that
/// CubeCL registers from SM100, which has tensor maps but no `wgmma`.
pub fn has_wgmma(device: &Device) -> bool {
    match device.clone().without_autodiff().as_dispatch() {
        DispatchDevice::Cube(cube) => {
            let client = cube.client();
            let tma = &client.properties().features.tma;
            tma.contains(Tma::Base) && !tma.contains(Tma::Im2colWide)
        }
        #[allow(unreachable_patterns)]
        other => panic!("not a CubeCL device: {other:?}"),
    }
}

/// Whether this device has the tensor memory accelerator (SM90 and newer), by which the forward
/// and the dK/dV launch stage their blocks at head dims 64 and 128: CubeCL's `Tma::Base` feature.
pub fn has_tma(device: &Device) -> bool {
    match device.clone().without_autodiff().as_dispatch() {
        DispatchDevice::Cube(cube) => {
            let client = cube.client();
            client.properties().features.tma.contains(Tma::Base)
        }
        #[allow(unreachable_patterns)]
        other => panic!("not a CubeCL device: {other:?}"),
    }
}

/// Whether a benchmark shape (16-bit, every query block whole) takes the Hopper forward: on
/// SM90 at head dims 64 and 128 where its queries walk 1024 keys or more (half the keys when
/// causal), or wherever `BURN_FLASH_WARPGROUP` says.
pub fn hopper_forward(device: &Device, head_dim: usize, n: usize, causal: bool) -> bool {
    let walked = if causal { n / 2 } else { n };
    has_wgmma(device)
        && matches!(head_dim, 64 | 128)
        && super::warpgroup_override().unwrap_or(walked >= 1024)
}
