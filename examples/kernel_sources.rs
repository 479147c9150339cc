//! The CUDA C++ that CubeCL's CUDA backend generates for the fused kernels on an H100, written
//! without a GPU:
//!
//! ```text
//! cargo run --release --features cuda --example kernel_sources -- OUTDIR [--d 64,128]
//! scripts/profile/kernel-sources.sh OUTDIR   # the same, then NVRTC + ptxas on the fused kernels
//! ```
//!
//! Register counts, spills and SASS of the kernels (`scripts/profile/ptxas/compile.sh`) need their
//! source, which CubeCL only produces inside a launch. This runs the public API (bf16, b 1, h 2,
//! seq 256, per head dim: forward, then forward + backward with the deterministic and the atomic
//! dQ, each without and with the causal mask; the atomic one again with its last wave's cubes in
//! pieces (`backward::tail`); then the forward with a per-pair boolean mask,
//! with a bias, with a softcap, causal with ALiBi, and the forward + deterministic backward with
//! dropout) on
//! `FakeCuda`: a runtime with CubeCL's CUDA
//! compiler and the device properties the CUDA runtime reports for an H100 (sm_90, 132 SMs,
//! 227 KiB of shared memory per block), whose server compiles each new kernel as the CUDA
//! server does and writes its source instead of running it. The kernels specialise on the
//! comptime configuration only, so the sequence length does not matter.
//!
//! Each kernel is written once, as `OUTDIR/<entry point>_<run>.cu` for the first run that
//! launched it (runs `d128_causal` forward, `d128_causal_det` and `d128_causal_atomic` backward,
//! and so on), beside a `.meta` with its name, kernel id, cube dim, cube count and shared memory.
//! Nothing runs, so every read returns zeros. The properties mirror `cubecl-cuda` 0.10's
//! `runtime.rs` for compute capability 9.0 with `cudarc` built for CUDA 13 (as the GPU binaries
//! are: no `nvcc` here, `fallback-latest`); keep them in step when CubeCL is updated. CubeCL
//! lays out shared memory in hash-set order, so offsets (and a few instructions) vary between
//! processes, on the GPU too.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use burn::backend::Autodiff;
use burn::tensor::backend::{Backend, DeviceOps};
use burn::tensor::{Bool, Tensor};
use burn_cubecl::CubeBackend;
use burn_flash::{AttentionMask, FlashAttentionOptions, flash_attention, flash_attention_masked};
use cubecl::backtrace::BackTrace;
use cubecl::bytes::Bytes;
use cubecl::client::ComputeClient;
use cubecl::cuda::{CUDA_MAX_BINDINGS, CudaCompiler, CudaRuntime};
use cubecl::device::{Device, DeviceId, DeviceService, ServerUtilitiesHandle};
use cubecl::features::{AtomicUsage, Plane, Tma, TypeUsage};
use cubecl::future::DynFut;
use cubecl::ir::{
    BarrierLevel, DeviceProperties, ElemType, FloatKind, HardwareProperties,
    MemoryDeviceProperties, OpaqueType, SemanticType, StorageType, TargetProperties, Type,
    VectorSize,
};
use cubecl::prelude::{CubeCount, ExecutionMode};
use cubecl::profile::{ProfileDuration, TimingMethod};
use cubecl::server::{
    Binding, ComputeServer, CopyDescriptor, KernelArguments, ProfileError, ProfilingToken,
    ServerCommunication, ServerError, ServerUtilities,
};
use cubecl::stream_id::StreamId;
use cubecl::zspace::{Shape, Strides};
use cubecl::{CubeTask, MemoryAllocationMode, MemoryUsage, Runtime};
use cubecl_cpp::cuda::mma::CudaWmmaCompiler;
use cubecl_cpp::cuda::{CudaDialect, arch::CudaArchitecture};
use cubecl_cpp::shared::{
    CompilationOptions, CppSupportedFeatures, register_mma_features, register_wmma_features,
};
use cubecl_cpp::{DialectWmmaCompiler, register_supported_types};
use cubecl_runtime::allocator::PitchedMemoryLayoutPolicy;
use cubecl_runtime::id::KernelId;
use cubecl_runtime::logging::ServerLogger;
use cubecl_runtime::memory_management::ManagedMemoryHandle;
use cubecl_runtime::storage::{BytesResource, BytesStorage, ManagedResource};
use cubecl_runtime::validation::{validate_cube_dim, validate_units};

type Cube = CubeBackend<FakeCuda, half::bf16, i32, u8>;

/// Where the server writes, set once by `main` before the first launch.
static OUT_DIR: OnceLock<PathBuf> = OnceLock::new();
/// The run the launches belong to (part of the file names); `main` syncs after each run.
static RUN: Mutex<String> = Mutex::new(String::new());

/// The only device of `FakeCuda`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
struct FakeH100;

impl Device for FakeH100 {
    fn from_id(_id: DeviceId) -> Self {
        Self
    }

    fn to_id(&self) -> DeviceId {
        DeviceId::new(0, 0)
    }
}

impl DeviceOps for FakeH100 {}

/// `CudaRuntime` with `SourceServer` in place of the CUDA server (the rest delegates to it).
#[derive(Clone, Debug)]
struct FakeCuda;

impl Runtime for FakeCuda {
    type Compiler = CudaCompiler;
    type Server = SourceServer;
    type Device = FakeH100;

    fn client(device: &FakeH100) -> ComputeClient<Self> {
        ComputeClient::load(device)
    }

    fn name(_client: &ComputeClient<Self>) -> &'static str {
        "cuda"
    }

    fn require_array_lengths() -> bool {
        CudaRuntime::require_array_lengths()
    }

    fn max_cube_count() -> (u32, u32, u32) {
        CudaRuntime::max_cube_count()
    }

    fn can_read_tensor(shape: &Shape, strides: &Strides) -> bool {
        CudaRuntime::can_read_tensor(shape, strides)
    }

    fn target_properties() -> TargetProperties {
        CudaRuntime::target_properties()
    }

    fn enumerate_devices(_type_id: u16, _info: &()) -> Vec<DeviceId> {
        vec![DeviceId::new(0, 0)]
    }
}

/// What `cubecl-cuda` reports for an H100 SXM (compute capability 9.0): its server's
/// initialisation with the driver's answers filled in and the architecture tests resolved.
fn h100() -> (DeviceProperties, CompilationOptions) {
    let arch = CudaArchitecture { version: 90 };
    type Wmma = CudaWmmaCompiler;
    type Dialect = CudaDialect<Wmma>;
    let wmma = <Wmma as DialectWmmaCompiler<Dialect>>::supported_wmma_combinations(&arch);
    let mma = <Wmma as DialectWmmaCompiler<Dialect>>::supported_mma_combinations(&arch);
    let hardware = HardwareProperties {
        load_width: 128,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: CUDA_MAX_BINDINGS,
        max_shared_memory_size: 232_448, // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        max_cube_count: (i32::MAX as u32, u16::MAX as u32, u16::MAX as u32),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: Some(132),
        num_tensor_cores: Some(4),
        min_tensor_cores_dim: (!wmma.is_empty()).then_some(8),
        num_cpu_cores: None,
        max_vector_size: VectorSize::MAX,
    };
    // A quarter of the 80 GB: only the memory pools read it.
    let memory = MemoryDeviceProperties {
        max_page_size: 85_520_809_984 / 4,
        alignment: 512,
    };
    let mut props =
        DeviceProperties::new(Default::default(), memory, hardware, TimingMethod::System);
    register_supported_types(&mut props);
    props.register_type_usage(ElemType::Float(FloatKind::TF32), TypeUsage::Conversion);
    let atomic = |kind| Type::new(StorageType::Atomic(ElemType::Float(kind)));
    let add = AtomicUsage::Add | AtomicUsage::LoadStore;
    // SM60+, SM70+
    props.register_atomic_type_usage(atomic(FloatKind::F64), add);
    props.register_atomic_type_usage(atomic(FloatKind::F16), add);
    props.register_atomic_type_usage(atomic(FloatKind::F16).with_vector_size(2), add);
    props.register_semantic_type(SemanticType::Pipeline);
    props.register_type_usage(OpaqueType::Barrier(BarrierLevel::Unit), TypeUsage::Buffer);
    props.register_type_usage(OpaqueType::Barrier(BarrierLevel::Cube), TypeUsage::Buffer);
    props.features.plane.insert(Plane::Sync);
    // SM75+, SM80+
    let half_types =
        [FloatKind::F16, FloatKind::BF16].map(|kind| StorageType::from(ElemType::Float(kind)));
    props.features.matmul.ldmatrix.extend(half_types);
    props.features.copy_async = true;
    // SM89+
    for fp8 in [FloatKind::E4M3, FloatKind::E5M2] {
        let usage = TypeUsage::Conversion | TypeUsage::Buffer;
        props.register_type_usage(ElemType::Float(fp8), usage);
    }
    // SM90+
    props.features.tma.insert(Tma::Base);
    props.register_semantic_type(SemanticType::TensorMap);
    props.features.cube_cluster = true;
    props.features.matmul.stmatrix.extend(half_types);
    props.register_atomic_type_usage(atomic(FloatKind::F32).with_vector_size(2), add);
    props.register_atomic_type_usage(atomic(FloatKind::F32).with_vector_size(4), add);
    // All
    props.features.memory_reinterpret = true;
    props.features.alignment = true;
    props.features.plane.insert(Plane::Ops);
    props.features.plane.insert(Plane::NonUniformControlFlow);
    register_wmma_features(wmma, &mut props);
    register_mma_features(mma, &mut props);
    // (No scaled MMA below SM100.)
    let options = CompilationOptions {
        warp_size: 32,
        supports_features: CppSupportedFeatures {
            fast_math: true,
            grid_constants: true, // SM70+
            fast_tanh: true,      // SM75+ and cudarc's CUDA_VERSION >= 12.8
            clusters: true,       // SM90+
            elect_sync: true,     // SM90+
        },
    };
    (props, options)
}

/// Compiles each new kernel as `cubecl-cuda`'s `CudaContext::compile_kernel` does and writes
/// its source; allocations are never backed (the client lays them out itself).
#[derive(Debug)]
struct SourceServer {
    utilities: Arc<ServerUtilities<Self>>,
    options: CompilationOptions,
    written: HashSet<KernelId>,
    names: HashMap<String, usize>,
}

impl DeviceService for SourceServer {
    fn init(_id: DeviceId) -> Self {
        let (props, options) = h100();
        let policy = PitchedMemoryLayoutPolicy::new(props.memory.alignment as usize);
        let logger = Arc::new(ServerLogger::default());
        Self {
            utilities: Arc::new(ServerUtilities::new(props, logger, (), policy)),
            options,
            written: HashSet::new(),
            names: HashMap::new(),
        }
    }

    fn utilities(&self) -> ServerUtilitiesHandle {
        self.utilities.clone()
    }
}

impl ServerCommunication for SourceServer {
    const SERVER_COMM_ENABLED: bool = false;
}

/// The error of what this server does not have.
fn unsupported(what: &str) -> ServerError {
    ServerError::Generic {
        reason: format!("the source-writing server has no {what}"),
        backtrace: BackTrace::capture(),
    }
}

/// A failed launch ends the process: it would have failed on the device too.
fn fail(what: &str, error: impl std::fmt::Display) -> ! {
    eprintln!("{what}: {error}");
    std::process::exit(1)
}

impl SourceServer {
    fn write_source(
        &mut self,
        kernel: Box<dyn CubeTask<CudaCompiler>>,
        count: CubeCount,
        mode: ExecutionMode,
    ) {
        let mut id = kernel.id();
        id.mode(mode);
        if !self.written.insert(id.clone()) {
            return;
        }
        let props = &self.utilities.properties;
        let what = kernel.name();
        validate_cube_dim(props, &id).unwrap_or_else(|e| fail(what, e));
        validate_units(props, &id).unwrap_or_else(|e| fail(what, e));
        let address = kernel.address_type();
        let compiled = (kernel.compile(&mut Default::default(), &self.options, mode, address))
            .unwrap_or_else(|e| fail(what, e));
        let shared = compiled.repr.as_ref().map_or(0, |r| r.shared_memory_size());
        if shared > props.hardware.max_shared_memory_size {
            fail(what, format!("{shared} bytes of shared memory"));
        }
        // `<entry point>_<run>`, numbered from the second kernel of the same name on.
        let mut name = format!("{}_{}", compiled.entrypoint_name, RUN.lock().unwrap());
        let seen = self.names.entry(name.clone()).or_default();
        *seen += 1;
        if *seen > 1 {
            name = format!("{name}_{seen}");
        }
        let meta = format!(
            "name: {}\nid: {id:#?}\ncube_dim: {:?}\ncube_count: {count:?}\nshared_memory_bytes: {shared}\n",
            compiled.debug_name.unwrap_or(kernel.name()),
            compiled.cube_dim,
        );
        let dir = OUT_DIR.get().expect("main sets OUT_DIR");
        for (ext, text) in [("cu", &compiled.source), ("meta", &meta)] {
            let path = dir.join(format!("{name}.{ext}"));
            std::fs::write(&path, text).unwrap_or_else(|e| fail(&path.display().to_string(), e));
        }
    }
}

impl ComputeServer for SourceServer {
    type Kernel = Box<dyn CubeTask<CudaCompiler>>;
    type Info = ();
    type MemoryLayoutPolicy = PitchedMemoryLayoutPolicy;
    type Storage = BytesStorage;

    fn initialize_memory(&mut self, _memory: ManagedMemoryHandle, _size: u64, _stream: StreamId) {}

    fn logger(&self) -> Arc<ServerLogger> {
        self.utilities.logger.clone()
    }

    fn utilities(&self) -> Arc<ServerUtilities<Self>> {
        self.utilities.clone()
    }

    fn read(
        &mut self,
        descriptors: Vec<CopyDescriptor>,
        _stream: StreamId,
    ) -> DynFut<Result<Vec<Bytes>, ServerError>> {
        let zeros = descriptors
            .iter()
            .map(|d| Bytes::from_bytes_vec(vec![0; d.handle.size_in_used() as usize]))
            .collect();
        Box::pin(async move { Ok(zeros) })
    }

    fn write(&mut self, _descriptors: Vec<(CopyDescriptor, Bytes)>, _stream: StreamId) {}

    fn sync(&mut self, _stream: StreamId) -> DynFut<Result<(), ServerError>> {
        Box::pin(async { Ok(()) })
    }

    fn get_resource(
        &mut self,
        _binding: Binding,
        _stream: StreamId,
    ) -> Result<ManagedResource<BytesResource>, ServerError> {
        Err(unsupported("memory"))
    }

    unsafe fn launch(
        &mut self,
        kernel: Self::Kernel,
        count: CubeCount,
        _bindings: KernelArguments,
        mode: ExecutionMode,
        _stream: StreamId,
    ) {
        self.write_source(kernel, count, mode);
    }

    fn flush(&mut self, _stream: StreamId) -> Result<(), ServerError> {
        Ok(())
    }

    fn memory_usage(&mut self, _stream: StreamId) -> Result<MemoryUsage, ServerError> {
        Err(unsupported("memory"))
    }

    fn memory_cleanup(&mut self, _stream: StreamId) {}

    fn start_profile(&mut self, _stream: StreamId) -> Result<ProfilingToken, ServerError> {
        Err(unsupported("profiling"))
    }

    fn end_profile(
        &mut self,
        _stream: StreamId,
        _token: ProfilingToken,
    ) -> Result<ProfileDuration, ProfileError> {
        Err(ProfileError::NotRegistered {
            backtrace: BackTrace::capture(),
        })
    }

    fn allocation_mode(&mut self, _mode: MemoryAllocationMode, _stream: StreamId) {}
}

/// q, k and v of one head dim (the values do not matter: nothing runs).
fn inputs<B: Backend>(head_dim: usize) -> [Tensor<B, 4>; 3] {
    [(); 3].map(|()| Tensor::ones([1, 2, 256, head_dim], &Default::default()))
}

/// Runs `f` with launches labelled `run`, and waits until the server has written them all.
fn run(label: String, f: impl FnOnce()) {
    *RUN.lock().unwrap() = label;
    f();
    Cube::sync(&FakeH100).expect("sync");
}

fn main() {
    let mut args = std::env::args().skip(1);
    let usage = "usage: kernel_sources OUTDIR [--d 64,128]";
    let out = PathBuf::from(args.next().unwrap_or_else(|| fail(usage, "no OUTDIR")));
    let dims: Vec<usize> = match (args.next().as_deref(), args.next()) {
        (None, _) => vec![64, 128],
        (Some("--d"), Some(list)) => list
            .split(',')
            .map(|d| d.trim().parse())
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| fail(usage, e)),
        _ => fail(usage, "unexpected arguments"),
    };
    std::fs::create_dir_all(&out).unwrap_or_else(|e| fail(&out.display().to_string(), e));
    OUT_DIR.set(out.clone()).expect("set once");

    for d in dims {
        for (mask, options) in [
            ("full", FlashAttentionOptions::default()),
            ("causal", FlashAttentionOptions::causal()),
        ] {
            run(format!("d{d}_{mask}"), || {
                let [q, k, v] = inputs::<Cube>(d);
                flash_attention(q, k, v, options);
            });
            for (dq, deterministic) in [("det", true), ("atomic", false)] {
                run(format!("d{d}_{mask}_{dq}"), || {
                    // At 256 keys `with_deterministic(false)` alone keeps dQ's own launch.
                    let _atomic = (!deterministic).then(burn_flash::testing::force_atomic_dq);
                    // Its few cubes would all walk in pieces: that launch is the next run's.
                    let _whole = burn_flash::testing::tail_slots(0);
                    let [q, k, v] = inputs::<Autodiff<Cube>>(d).map(Tensor::require_grad);
                    let options = options.with_deterministic(deterministic);
                    flash_attention(q, k, v, options).backward();
                });
            }
        }
        // The atomic single pass with its last wave split: its 4 cubes planned for 3 slots
        // walk 3 whole, then 1 in 2 pieces; and the pieces' sum.
        run(format!("d{d}_full_atomic_tail"), || {
            let _atomic = burn_flash::testing::force_atomic_dq();
            let _split = burn_flash::testing::tail_slots(3);
            let [q, k, v] = inputs::<Autodiff<Cube>>(d).map(Tensor::require_grad);
            let options = FlashAttentionOptions::default().with_deterministic(false);
            flash_attention(q, k, v, options).backward();
        });
        // The forward with a per-pair boolean mask (packed into bits, staged as words).
        run(format!("d{d}_boolmask"), || {
            let [q, k, v] = inputs::<Cube>(d);
            let mask = Tensor::<Cube, 4, Bool>::empty([1, 1, 256, 256], &Default::default());
            let mask = Some(AttentionMask::Full(mask));
            flash_attention_masked(q, k, v, mask, None, FlashAttentionOptions::default());
        });
        // The forward with a `[1, h, n, n]` bias (staged in shared memory).
        run(format!("d{d}_bias"), || {
            let [q, k, v] = inputs::<Cube>(d);
            let bias = Tensor::<Cube, 4>::empty([1, 2, 256, 256], &Default::default());
            flash_attention_masked(q, k, v, None, Some(bias), FlashAttentionOptions::default());
        });
        // The forward with Gemma-2's softcap of the scaled scores (30, as the benchmark's rows).
        run(format!("d{d}_softcap"), || {
            let [q, k, v] = inputs::<Cube>(d);
            flash_attention(q, k, v, FlashAttentionOptions::default().with_softcap(30.0));
        });
        // ALiBi, causal: the distance's multiply-add and subtraction per score.
        run(format!("d{d}_alibi"), || {
            let [q, k, v] = inputs::<Cube>(d);
            flash_attention(q, k, v, FlashAttentionOptions::causal().with_alibi(true));
        });
        // Dropout: the forward, then both backward launches (deterministic dQ).
        let dropout = FlashAttentionOptions::default().with_dropout(0.1, 7);
        run(format!("d{d}_dropout"), || {
            let [q, k, v] = inputs::<Cube>(d);
            flash_attention(q, k, v, dropout);
        });
        run(format!("d{d}_dropout_det"), || {
            let [q, k, v] = inputs::<Autodiff<Cube>>(d).map(Tensor::require_grad);
            flash_attention(q, k, v, dropout).backward();
        });
    }
    println!("kernel sources in {}", out.display());
}
