//! Compile-time proof that the backends users get from Burn implement the trait.

use burn_cubecl::CubeBackend;

use crate::backend::FlashAttentionBackend;

type WgpuCube = CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
#[cfg(feature = "cuda")]
type CudaCube = CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

const fn implements<B: FlashAttentionBackend>() {}

const _: () = {
    implements::<burn::backend::Wgpu>();
    implements::<burn::backend::Wgpu<half::f16>>();
    implements::<WgpuCube>();
};

#[cfg(feature = "cuda")]
const _: () = {
    implements::<burn::backend::Cuda>();
    implements::<burn::backend::Cuda<half::bf16>>();
    implements::<burn::backend::Cuda<half::f16>>();
    implements::<CudaCube>();
};

// Burn's default aliases are the fusion backend over `CubeBackend`, so the `Fusion` impl is the
// one users get.
const _: fn(burn::backend::Wgpu) -> burn_fusion::Fusion<WgpuCube> = |backend| backend;
#[cfg(feature = "cuda")]
const _: fn(burn::backend::Cuda) -> burn_fusion::Fusion<CudaCube> = |backend| backend;
