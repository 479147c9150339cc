//! The CUDA C++ that CubeCL's CUDA backend (C++ through NVRTC) generates for the fused kernels on
//! an H100, written without a GPU:
//!
//! ```text
//! cargo run --release --features cuda -p burn-flash --example kernel_sources -- OUTDIR [--d 64,128] [--seq 4096]
//! scripts/profile/ptxas/compile.sh OUTDIR/*.cu   # NVRTC + ptxas: registers, spills, SASS
//! ```
//!
//! For bf16 and each head dim `d`, with and without the causal mask, it writes the forward
//! (`flash_forward_d<d>_<mask>`, on SM90 `warpgroup_forward_d<d>_<mask>` where the plan takes
//! the Hopper forward) and the backward with the deterministic dQ
//! (`key_value_grads_d<d>_<mask>_det`, on SM90 at head dim 128
//! `warpgroup_key_value_grads_d<d>_<mask>_det`, the Hopper backward without its atomic dQ;
//! then `query_grads_d<d>_<mask>_det`) and with the atomic dQ
//! (`key_value_grads_d<d>_<mask>_atomic`, forced wherever the device can run it, as
//! `burn_flash::testing::force_atomic_dq` does; where the plan splits the last wave, one file per
//! part, `_whole` and `_pieces`) and on SM90 the Hopper backward
//! (`warpgroup_key_value_grads_d<d>_<mask>_warpgroup`, as
//! `burn_flash::testing::force_warpgroup_backward` forces it; the `_atomic` files are the tile's,
//! as `burn_flash::testing::avoid_warpgroup_backward` keeps it), as `OUTDIR/<kernel>_<variant>.cu`,
//! beside a `.meta` with the
//! entry point, the plan, the cube dim and count, the shared memory and the comptime
//! configuration. `<mask>` is `full` or `causal`.
//!
//! The kernels come from `burn_flash::kernel::sources`: the launches' own plans, for contiguous
//! `[batch, heads, seq, d]` inputs (FlashAttention-2's benchmark shapes: `seq` keys, 16k tokens,
//! hidden size 2048, so `batch = 16384 / seq` and `heads = 2048 / d`), each kernel created by its
//! `create_dummy_kernel` and compiled here as `cubecl-cuda` compiles a launched one
//! (`CudaCompiler` on its C++ backend, the options below), its source written as NVRTC gets it.
//! The kernels specialise on the comptime configuration, which the shapes reach only through the
//! plans (the atomic dQ's last-wave split); the source is otherwise the same at any length, but
//! for the order CubeCL lays out shared memory in (hash-set order: offsets, and so a few
//! instructions, vary from one compilation to the next, on the GPU too).
//!
//! `cubecl-cuda` 0.12 fills a device's properties inside its server's initialisation, which needs
//! a CUDA context, so `h100` mirrors `runtime.rs` (`DeviceService for CudaServer`) for compute
//! capability 9.0 with the C++ backend (no `restrict_features`), with the driver's answers of an
//! H100 SXM filled in and `CUDA_VERSION` that of CUDA 13.0; keep it in step when CubeCL is
//! updated. The target properties are `CudaRuntime`'s own.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn_flash::FlashAttentionOptions;
use burn_flash::kernel::sources::{self, PlannedKernel, Problem, Target};
use clap::Parser;
use cubecl::Compiler;
use cubecl::cmma::{LdMatrixForm, StMatrixForm};
use cubecl::cuda::compiler::CudaBackend;
use cubecl::cuda::{CUDA_MAX_BINDINGS, CudaCompilationOptions, CudaCompiler, CudaRuntime};
use cubecl::ir::features::{AtomicUsage, ComplexUsage, Plane, Tma, TypeUsage};
use cubecl::ir::nvidia::SmArch;
use cubecl::ir::{
    ComplexKind, DeviceIdentity, DeviceProperties, ElemType, FloatKind, HardwareProperties,
    MemoryDeviceProperties, OpaqueType, PciVendor, PhysicalDevice, Type, VectorSize,
};
use cubecl_common::profile::TimingMethod;
use cubecl_cpp::cuda::arch::{CudaArchitecture, CudaToolkitVersion};
use cubecl_cpp::cuda::mma::CudaCmmaCompiler;
use cubecl_cpp::cuda::{supported_mma_combinations, supported_scaled_mma_combinations};
use cubecl_cpp::register_supported_types;
use cubecl_cpp::shared::{
    CompilationOptions, CppSupportedFeatures, register_mma_features, register_scaled_mma_features,
    register_wmma_features,
};
use cubecl_runtime::runtime::Runtime;

/// `cudarc`'s `CUDA_VERSION` for CUDA 13.0, the toolkit the GPU binaries are built with.
const CUDA_VERSION: u32 = 13000;

#[derive(Parser)]
#[command(about = "Write the CUDA C++ of the fused kernels on an H100, without a GPU")]
struct Args {
    /// Where to write `<kernel>_<variant>.cu` and `.meta`.
    out: PathBuf,
    /// Head dims (comma-separated).
    #[arg(long = "d", value_delimiter = ',', default_value = "64,128")]
    dims: Vec<usize>,
    /// Keys (and queries) per sequence.
    #[arg(long, default_value_t = 4096)]
    seq: usize,
}

/// What `cubecl-cuda` reports for an H100 SXM (compute capability 9.0), and the options it
/// compiles with: its server's initialisation with the driver's answers filled in.
fn h100() -> (DeviceProperties, CudaCompilationOptions) {
    let version = 90;
    // `CudaArchitecture::has_tensor_cores(90, name)`: every die from Volta on but Turing's GTX.
    let arch = CudaArchitecture {
        version,
        tensor_cores: true,
    };
    let cmma = CudaCmmaCompiler::Cpp.supported_cmma_combinations(&arch);
    let mma = supported_mma_combinations(&arch);
    let scaled_mma = supported_scaled_mma_combinations(&arch, CudaToolkitVersion(CUDA_VERSION));
    // `cuDeviceTotalMem` of the 80 GB part.
    let max_memory = 85_520_809_984;
    let memory = MemoryDeviceProperties::new(max_memory / 4, 512).with_max_memory(max_memory);
    let mut options = CompilationOptions {
        warp_size: 32,
        supports_features: CppSupportedFeatures {
            fast_math: true,
            dp4a: true, // SM61+
            ..Default::default()
        },
        ..Default::default()
    };
    let hardware = HardwareProperties {
        load_width: 128,
        vector_register_count: None,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: CUDA_MAX_BINDINGS,
        max_shared_memory_size: 232_448, // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 227 KiB
        max_cube_count: (i32::MAX as u32, u16::MAX as u32, u16::MAX as u32),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: Some(132),
        num_tensor_cores: Some(4),
        min_tensor_cores_dim: (!cmma.is_empty()).then_some(8),
        num_cpu_cores: None,
        last_level_cache_size: Some(50 * 1024 * 1024),
        max_vector_size: VectorSize::MAX,
        cube_mma_reserved_shared_memory: 0,
    };
    let mut physical = PhysicalDevice::default();
    physical.vendor = Some(PciVendor::Nvidia);
    let identity = DeviceIdentity {
        name: "NVIDIA H100 80GB HBM3".into(),
        fingerprint: format!("ptx_sm{version}"),
        physical: Some(physical),
    };
    let mut props = DeviceProperties::new(
        Default::default(),
        memory,
        hardware,
        TimingMethod::Device,
        identity,
    );
    register_supported_types(&mut props);
    for kind in [ComplexKind::C32, ComplexKind::C64] {
        let ty = ElemType::Complex(kind);
        props.register_type_usage(ty, TypeUsage::Conversion | TypeUsage::Buffer);
        props.register_complex_usage(
            ty,
            ComplexUsage::Core | ComplexUsage::Compare | ComplexUsage::Math,
        );
    }
    let exchange = AtomicUsage::Add | AtomicUsage::LoadStore | AtomicUsage::Exchange;
    // SM60+
    let f64 = Type::atomic(ElemType::Float(FloatKind::F64));
    props.register_atomic_type_usage(f64, exchange);
    props.register_shared_atomic_type_usage(f64, exchange);
    // SM70+
    let f16 = Type::atomic(ElemType::Float(FloatKind::F16));
    props.register_atomic_type_usage(f16, AtomicUsage::Add);
    props.register_shared_atomic_type_usage(f16, AtomicUsage::Add);
    let f16x2 = Type::atomic(Type::new(ElemType::Float(FloatKind::F16)).with_vector_size(2));
    props.register_atomic_type_usage(f16x2, exchange);
    props.register_opaque_type(OpaqueType::Barrier);
    props.features.plane.insert(Plane::Sync);
    options.supports_features.grid_constants = true;
    // SM75+
    let halves = [FloatKind::F16, FloatKind::BF16].map(ElemType::Float);
    props.features.matmul.ldmatrix.extend(halves);
    props
        .features
        .matmul
        .ldmatrix_forms
        .insert(LdMatrixForm::M8N8B16);
    options.supports_features.fast_tanh = CUDA_VERSION >= 12080;
    // SM80+
    props.register_type_usage(ElemType::Float(FloatKind::TF32), TypeUsage::Conversion);
    props.features.copy_async = true;
    // SM90+
    props.features.tma.insert(Tma::Base);
    props.register_opaque_type(OpaqueType::TensorMap);
    props.features.cube_cluster = true;
    options.supports_features.clusters = true;
    options.supports_features.elect_sync = true;
    props.features.matmul.stmatrix.extend(halves);
    props
        .features
        .matmul
        .stmatrix_forms
        .insert(StMatrixForm::M8N8B16);
    for vec in [2, 4, 8] {
        for kind in [FloatKind::BF16, FloatKind::F16] {
            let ty = Type::atomic(Type::new(kind).with_vector_size(vec));
            props.register_atomic_type_usage(ty, exchange);
        }
    }
    for vec in [4, 8] {
        for kind in [FloatKind::BF16, FloatKind::F16] {
            let ty = Type::atomic(Type::new(kind).with_vector_size(vec));
            props.register_atomic_type_usage(ty, AtomicUsage::MinMax);
        }
    }
    if CUDA_VERSION > 12080 {
        for vec in [2, 4] {
            let f32 = Type::new(ElemType::Float(FloatKind::F32)).with_vector_size(vec);
            props.register_atomic_type_usage(Type::atomic(f32), exchange);
        }
    }
    // Before SM100: fp4 pairs decoded in software.
    let e2m1x2 = ElemType::Float(FloatKind::E2M1x2);
    props.register_type_usage(e2m1x2, TypeUsage::Conversion | TypeUsage::Buffer);
    props.register_emulated_conversion(e2m1x2);
    // All
    props.features.memory_reinterpret = true;
    props.features.alignment = true;
    props.features.device_memory_scope = true;
    props.features.plane.insert(Plane::Ops);
    props.features.plane.insert(Plane::NonUniformControlFlow);
    register_wmma_features(cmma, &mut props);
    register_mma_features(mma, &mut props);
    register_scaled_mma_features(scaled_mma, &mut props);
    let options = CudaCompilationOptions {
        cpp: options,
        arch: Some(SmArch::new(version, arch.tensor_cores)),
        // Read by the LLVM backend only (`PtxVersion::for_driver`).
        ptx_version: None,
    };
    (props, options)
}

/// Compiles `planned` as `cubecl-cuda` compiles a launched kernel and writes its source and
/// `.meta` as `dir/<name>.cu` and `dir/<name>.meta`; returns the path of the source.
fn write(
    dir: &Path,
    name: &str,
    planned: &PlannedKernel,
    props: &DeviceProperties,
    options: &CudaCompilationOptions,
) -> Result<PathBuf, String> {
    let definition = cubecl::define_kernel(&*planned.kernel).map_err(|e| e.to_string())?;
    let entry_point = definition.settings.kernel_name.clone();
    let compiled = CudaCompiler::new(CudaBackend::Cpp)
        .compile(definition, options)
        .map_err(|e| e.to_string())?;
    let shared = compiled.shared_memory_size();
    if shared > props.hardware.max_shared_memory_size {
        return Err(format!("{shared} bytes of shared memory"));
    }
    let meta = format!(
        "name: {}\nentry_point: {entry_point}\nplan: {}\ncube_dim: {:?}\ncube_count: {:?}\n\
         shared_memory_bytes: {shared}\nconfig: {}\n",
        planned.kernel.name(),
        planned.plan,
        planned.cube_dim,
        planned.cube_count,
        planned.config,
    );
    let source = dir.join(format!("{name}.cu"));
    for (path, text) in [
        (&source, compiled.to_string()),
        (&dir.join(format!("{name}.meta")), meta),
    ] {
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(source)
}

fn main() {
    if let Err(error) = run(Args::parse()) {
        eprintln!("{error}");
        std::process::exit(1);
    }
}

/// Writes every variant of every head dim of `args`, printing each source's path.
fn run(args: Args) -> Result<(), String> {
    let (props, compilation) = h100();
    let target = Target {
        device: Arc::new(props.clone()),
        target: Arc::new(CudaRuntime::target_properties()),
    };
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    for &head_dim in &args.dims {
        let problem = |options| Problem {
            dtype: ElemType::Float(FloatKind::BF16),
            batch: (16384 / args.seq.max(1)).max(1),
            heads: (2048 / head_dim.max(1)).max(1),
            seq: args.seq,
            head_dim,
            options,
        };
        for (mask, causal) in [("full", false), ("causal", true)] {
            let options = FlashAttentionOptions::new().with_causal(causal);
            let variant = format!("d{head_dim}_{mask}");
            let forward = sources::forward(&target, &problem(options))?;
            let det = sources::backward(&target, &problem(options.with_deterministic(true)))?;
            // The tile's dK/dV launch (the SM80 path), and the Hopper backward (on SM90 the
            // default at head dim 128, `docs/hopper.md`), each forced.
            let atomic = {
                let _forced = burn_flash::testing::force_atomic_dq();
                let _tile = burn_flash::testing::avoid_warpgroup_backward();
                sources::backward(&target, &problem(options.with_deterministic(false)))?
            };
            let warpgroup = {
                let _forced = burn_flash::testing::force_atomic_dq();
                let _hopper = burn_flash::testing::force_warpgroup_backward();
                sources::backward(&target, &problem(options.with_deterministic(false)))?
            };
            let launches = [
                (variant.clone(), forward),
                (format!("{variant}_det"), det),
                (format!("{variant}_atomic"), atomic),
                (format!("{variant}_warpgroup"), warpgroup),
            ];
            for (variant, kernels) in launches {
                for planned in &kernels {
                    let name = match planned.part {
                        Some(part) => format!("{}_{variant}_{part}", planned.name),
                        None => format!("{}_{variant}", planned.name),
                    };
                    let path = write(&args.out, &name, planned, &props, &compilation)
                        .map_err(|e| format!("{name}: {e}"))?;
                    println!("{}", path.display());
                }
            }
        }
    }
    Ok(())
}
