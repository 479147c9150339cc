#!/usr/bin/env python3
"""Assemble a kernel's PTX on the GPU machine the way CubeCL 0.12 does (cuLinkCreate,
cuLinkAddData, cuLinkComplete: relocatable, as `compile.sh`'s `-c`) and the way
cuModuleLoadDataEx does (whole program), printing the JIT's verbose log of each and whether the
linked machine code kept `setmaxnreg` (USETMAXREG): ptxas drops it, with note C7504, where it
assembles relocatable code.

    python3 scripts/profile/ptxas/link-check.py out/cu13-sm_90a/KERNEL.ptx   (needs cuobjdump)
"""
import ctypes
import subprocess
import sys

INFO_LOG, INFO_SIZE, ERROR_LOG, ERROR_SIZE, VERBOSE = 3, 4, 5, 6, 12
LOG_BYTES = 1 << 16

cu = ctypes.CDLL("libcuda.so.1")


def check(result, what):
    if result != 0:
        raise SystemExit(f"{what} failed: CUresult {result}")


def jit_options():
    info = ctypes.create_string_buffer(LOG_BYTES)
    error = ctypes.create_string_buffer(LOG_BYTES)
    keys = (ctypes.c_int * 5)(INFO_LOG, INFO_SIZE, ERROR_LOG, ERROR_SIZE, VERBOSE)
    values = (ctypes.c_void_p * 5)(
        ctypes.cast(info, ctypes.c_void_p), LOG_BYTES,
        ctypes.cast(error, ctypes.c_void_p), LOG_BYTES, 1)
    return keys, values, info


check(cu.cuInit(0), "cuInit")
device = ctypes.c_int()
check(cu.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
context = ctypes.c_void_p()
check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
check(cu.cuCtxSetCurrent(context), "cuCtxSetCurrent")
ptx = open(sys.argv[1], "rb").read() + b"\0"

keys, values, info = jit_options()
state = ctypes.c_void_p()
check(cu.cuLinkCreate_v2(5, keys, values, ctypes.byref(state)), "cuLinkCreate")
check(cu.cuLinkAddData_v2(state, 1, ptx, len(ptx), b"kernel", 0, None, None), "cuLinkAddData")
cubin, size = ctypes.c_void_p(), ctypes.c_size_t()
check(cu.cuLinkComplete(state, ctypes.byref(cubin), ctypes.byref(size)), "cuLinkComplete")
with open("/tmp/linked.cubin", "wb") as out:
    out.write(ctypes.string_at(cubin, size.value))
print("== cuLink (as CubeCL 0.12) info log:\n" + info.value.decode(errors="replace"))
sass = subprocess.run(["cuobjdump", "-sass", "/tmp/linked.cubin"], capture_output=True, text=True)
print("cuLink machine code: USETMAXREG", sass.stdout.count("USETMAXREG"))

keys, values, info = jit_options()
module = ctypes.c_void_p()
check(cu.cuModuleLoadDataEx(ctypes.byref(module), ptx, 5, keys, values), "cuModuleLoadDataEx")
print("== cuModuleLoadDataEx info log:\n" + info.value.decode(errors="replace"))
