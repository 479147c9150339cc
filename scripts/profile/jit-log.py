#!/usr/bin/env python3
"""Assemble a PTX file the way CubeCL 0.12 does (the driver's cuLinkAddData: relocatable code)
and print the assembler's log, performance notes (C75xx) included; the machine code goes to
OUT.cubin for cuobjdump. Runs where a CUDA driver is (the GPU machine), with nothing but ctypes.

    python3 scripts/profile/jit-log.py kernel.ptx OUT.cubin

scripts/profile/ptxas/compile.sh gives the same notes without a GPU (`ptxas -c`).
"""
import ctypes
import sys

# CUjit_option values (cuda.h).
INFO_LOG, INFO_LOG_SIZE, ERROR_LOG, ERROR_LOG_SIZE, LOG_VERBOSE = 3, 4, 5, 6, 12
INPUT_PTX = 1
LOG_BYTES = 1 << 20


def check(result, call):
    if result != 0:
        raise SystemExit(f"{call} failed: CUresult {result}")


def main(ptx_path, cubin_path):
    cuda = ctypes.CDLL("libcuda.so.1")
    check(cuda.cuInit(0), "cuInit")
    device, context = ctypes.c_int(), ctypes.c_void_p()
    check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    info, error = ctypes.create_string_buffer(LOG_BYTES), ctypes.create_string_buffer(LOG_BYTES)
    options = [INFO_LOG, INFO_LOG_SIZE, ERROR_LOG, ERROR_LOG_SIZE, LOG_VERBOSE]
    values = [ctypes.addressof(info), LOG_BYTES, ctypes.addressof(error), LOG_BYTES, 1]
    state = ctypes.c_void_p()
    check(
        cuda.cuLinkCreate_v2(
            len(options),
            (ctypes.c_int * len(options))(*options),
            (ctypes.c_void_p * len(values))(*values),
            ctypes.byref(state),
        ),
        "cuLinkCreate",
    )
    ptx = open(ptx_path, "rb").read() + b"\0"
    added = cuda.cuLinkAddData_v2(state, INPUT_PTX, ptx, len(ptx), b"kernel", 0, None, None)
    print(info.value.decode(errors="replace"))
    print(error.value.decode(errors="replace"), file=sys.stderr)
    check(added, "cuLinkAddData")
    cubin, size = ctypes.c_void_p(), ctypes.c_size_t()
    check(cuda.cuLinkComplete(state, ctypes.byref(cubin), ctypes.byref(size)), "cuLinkComplete")
    with open(cubin_path, "wb") as out:
        out.write(ctypes.string_at(cubin, size.value))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
