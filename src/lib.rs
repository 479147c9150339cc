//! Helpers shared by the tests, benchmarks and examples of `burn-flash` (this package is not
//! published; the library is `crates/burn-flash`).

/// Probe, once per process, whether a CUDA device answers: create the default device and run a
/// first operation on it. Returns the device, or why there is none.
///
/// Without a driver or a GPU, CubeCL's CUDA runtime panics on its own device thread and the
/// caller only sees a closed channel; the panic messages are recorded while the probe runs (not
/// printed), so the reason given is the driver's, e.g. "Unable to dynamically load the "cuda"
/// shared library".
#[cfg(feature = "cuda")]
pub fn cuda_device() -> Result<burn::backend::cuda::CudaDevice, String> {
    use std::panic::{self, PanicHookInfo};
    use std::sync::{Arc, Mutex, OnceLock};

    use burn::backend::Cuda;
    use burn::backend::cuda::CudaDevice;
    use burn::tensor::Tensor;

    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    let probe = PROBE.get_or_init(|| {
        let messages = Arc::new(Mutex::new(Vec::<String>::new()));
        type Hook = Box<dyn Fn(&PanicHookInfo<'_>) + Send + Sync>;
        let previous: Arc<Hook> = Arc::new(panic::take_hook());
        {
            // Panics of this thread and of CubeCL's device threads ("DSD-...") during the probe
            // are expected without a GPU: record them quietly. Any other thread's panic is
            // recorded and still reported as usual.
            let (messages, previous) = (messages.clone(), previous.clone());
            let prober = std::thread::current().id();
            panic::set_hook(Box::new(move |info| {
                if let Ok(mut messages) = messages.lock() {
                    messages.push(panic_message(info.payload()));
                }
                let thread = std::thread::current();
                let expected = thread.id() == prober
                    || thread.name().is_some_and(|name| name.starts_with("DSD"));
                if !expected {
                    previous(info);
                }
            }));
        }
        let result = panic::catch_unwind(|| {
            let device = CudaDevice::default();
            let x = Tensor::<Cuda, 1>::from_floats([1.0, 2.0, 3.0], &device);
            let sum = x.sum().into_data().iter::<f64>().next();
            if sum == Some(6.0) {
                Ok(())
            } else {
                Err(format!("a first operation on the device returned {sum:?}"))
            }
        });
        // Put the previous hook back.
        drop(panic::take_hook());
        panic::set_hook(Box::new(move |info| previous(info)));

        result.unwrap_or_else(|payload| {
            let first = messages
                .lock()
                .ok()
                .and_then(|messages| messages.first().cloned())
                .unwrap_or_else(|| panic_message(payload.as_ref()));
            let mut reason: String = first.chars().take(160).collect();
            if reason.len() < first.len() {
                reason.push_str("...");
            }
            Err(reason)
        })
    });
    probe.clone().map(|()| CudaDevice::default())
}

#[cfg(feature = "cuda")]
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic without a message".into())
}
