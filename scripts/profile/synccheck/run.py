"""Load probe.cubin with the CUDA driver API (ctypes) and launch it once; checks the result.

    compute-sanitizer --tool synccheck python3 scripts/profile/synccheck/run.py probe.cubin
"""
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
def ok(r):
    if r != 0: raise SystemExit(f"CUDA error {r}")
ok(cuda.cuInit(0)); dev = ctypes.c_int(); ok(cuda.cuDeviceGet(ctypes.byref(dev), 0))
ctx = ctypes.c_void_p(); ok(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)); ok(cuda.cuCtxSetCurrent(ctx))
mod = ctypes.c_void_p(); data = open(sys.argv[1], "rb").read()
ok(cuda.cuModuleLoadData(ctypes.byref(mod), data))
fn = ctypes.c_void_p(); ok(cuda.cuModuleGetFunction(ctypes.byref(fn), mod, b"probe"))
blocks = 6; n = blocks * 128 * 4
src_h = (ctypes.c_int * n)(*range(n)); out_h = (ctypes.c_int * (128 * 4))()
src = ctypes.c_uint64(); out = ctypes.c_uint64()
ok(cuda.cuMemAlloc_v2(ctypes.byref(src), n * 4)); ok(cuda.cuMemAlloc_v2(ctypes.byref(out), 128 * 16))
ok(cuda.cuMemcpyHtoD_v2(src, src_h, n * 4))
b = ctypes.c_int(blocks)
args = (ctypes.c_void_p * 3)(ctypes.cast(ctypes.byref(src), ctypes.c_void_p), ctypes.cast(ctypes.byref(out), ctypes.c_void_p), ctypes.cast(ctypes.byref(b), ctypes.c_void_p))
ok(cuda.cuLaunchKernel(fn, 1, 1, 1, 128, 1, 1, 0, None, args, None))
ok(cuda.cuCtxSynchronize()); ok(cuda.cuMemcpyDtoH_v2(out_h, out, 128 * 16))
expect = [sum(src_h[(bb * 128 + (t + 1) % 128) * 4 + c] for bb in range(blocks)) for t in range(128) for c in range(4)]
print("result", "ok" if list(out_h) == expect else "WRONG")
