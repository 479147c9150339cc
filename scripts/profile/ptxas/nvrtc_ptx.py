#!/usr/bin/env python3
"""Compile a CubeCL-generated CUDA source to PTX with NVRTC (via ctypes),
using the same options CubeCL passes, then write <out>.ptx.

usage: nvrtc_ptx.py LIBNVRTC SRC.cu OUT.ptx ARCH INCDIR [INCDIR...]
Trailing markdown fence lines ("```") are stripped from the source.
"""
import ctypes, sys

lib_path, src_path, out_path, arch, *incs = sys.argv[1:]
nvrtc = ctypes.CDLL(lib_path)

def check(res, what, prog=None):
    if res != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        msg = nvrtc.nvrtcGetErrorString(res).decode()
        if prog is not None:
            print_log(prog)
        sys.exit(f"{what} failed: {msg} ({res})")

def print_log(prog):
    n = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetProgramLog(prog, buf)
    s = buf.value.decode(errors="replace").strip()
    if s:
        print(s, file=sys.stderr)

lines = open(src_path).read().split("\n")
while lines and lines[-1].strip() in ("", "```"):
    lines.pop()
src = ("\n".join(lines) + "\n").encode()

major, minor = ctypes.c_int(), ctypes.c_int()
nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
print(f"NVRTC {major.value}.{minor.value}", file=sys.stderr)

prog = ctypes.c_void_p()
check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, src_path.encode(), 0, None, None),
      "nvrtcCreateProgram")
opts = [f"--gpu-architecture={arch}"] + [f"--include-path={i}" for i in incs] + ["-lineinfo"]
print("NVRTC options:", " ".join(opts), file=sys.stderr)
copts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
res = nvrtc.nvrtcCompileProgram(prog, len(opts), copts)
print_log(prog)
check(res, "nvrtcCompileProgram")

n = ctypes.c_size_t()
check(nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(n)), "nvrtcGetPTXSize")
buf = ctypes.create_string_buffer(n.value)
check(nvrtc.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
open(out_path, "wb").write(buf.value)
nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
