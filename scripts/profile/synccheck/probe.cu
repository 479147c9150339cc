// Minimal probe: CubeCL's staging pattern (cp.async + cp.async.mbarrier.arrive, then
// cuda::barrier::arrive_and_wait), to see what compute-sanitizer's synccheck says about it
// outside our kernels. One block of 128 threads, two barriers used alternately as in the
// double-buffered K/V pipeline.
//
//   nvcc -arch=sm_90a -cubin -o probe.cubin probe.cu   (then run.py under compute-sanitizer)
#include <cuda/barrier>
typedef uint64_t uint64;
typedef unsigned int uint32;

__device__ inline void cp_async_arrive(cuda::barrier<cuda::thread_scope_block> &bar) {
  uint64 *mbar = cuda::device::barrier_native_handle(bar);
  uint32 addr = static_cast<uint32>(__cvta_generic_to_shared(mbar));
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(addr));
}

__device__ inline void cp_async16(const void *src, void *dst) {
  uint32 d = static_cast<uint32>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, 16;\n" ::"r"(d), "l"(src));
}

extern "C" __global__ void probe(const int4 *src, int4 *out, int blocks) {
  __shared__ int4 stage[2][128];
  __shared__ cuda::barrier<cuda::thread_scope_block> bars[2];
  if (threadIdx.x == 0) {
    init(&bars[0], blockDim.x);
    init(&bars[1], blockDim.x);
  }
  __syncthreads();
  cp_async16(&src[threadIdx.x], &stage[0][threadIdx.x]);
  cp_async_arrive(bars[0]);
  int4 acc = make_int4(0, 0, 0, 0);
  for (int b = 0; b < blocks; ++b) {
    int s = b % 2;
    bars[s].arrive_and_wait();
    if (b + 1 < blocks) {
      cp_async16(&src[(b + 1) * 128 + threadIdx.x], &stage[1 - s][threadIdx.x]);
      cp_async_arrive(bars[1 - s]);
    }
    int4 v = stage[s][(threadIdx.x + 1) % 128];
    acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
  }
  out[threadIdx.x] = acc;
}
