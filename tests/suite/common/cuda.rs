//! CUDA-only helpers of the integration tests.

use std::io::Write;

use burn::backend::cuda::CudaDevice;
use burn::tensor::DType;

/// The CUDA device, or `None` (with a `skipping: ...` line on stderr) when there is none.
pub fn cuda_device(test: &str) -> Option<CudaDevice> {
    match burn_flash_suite::cuda_device() {
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
/// accumulation, asynchronous copies: SM80 and newer). On such a device, bf16/f16 with head dims
/// 32, 64, 96, 128 or 256 must run on the tensor cores.
pub fn has_tensor_cores(device: &CudaDevice, dtype: DType) -> bool {
    use cubecl::Runtime;
    use cubecl::features::MmaConfig;
    let client = cubecl::cuda::CudaRuntime::client(device);
    let features = &client.properties().features;
    let mma = MmaConfig {
        a_type: dtype.into(),
        b_type: dtype.into(),
        cd_type: DType::F32.into(),
        m: 16,
        n: 8,
        k: 16,
    };
    features.matmul.mma.contains(&mma) && features.copy_async
}

/// Whether this device has the tensor memory accelerator (SM90 and newer), by which the forward
/// and the dK/dV launch stage their blocks at head dims 64 and 128.
pub fn has_tma(device: &CudaDevice) -> bool {
    use cubecl::Runtime;
    use cubecl::features::Tma;
    let client = cubecl::cuda::CudaRuntime::client(device);
    client.properties().features.tma.contains(Tma::Base)
}
