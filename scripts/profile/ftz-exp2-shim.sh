#!/usr/bin/env bash
# Measurement experiment, not a feature: what CubeCL 0.10's lack of a flush-to-zero exp2 costs.
#
#   scripts/profile/ftz-exp2-shim.sh CUDA_ROOT SHIM_ROOT
#   CUDA_PATH=SHIM_ROOT .gpu/bench-attention ...      # same binary, exp2 without the fix-ups
#
# CubeCL compiles each kernel with NVRTC against $CUDA_PATH/include (default /usr/local/cuda).
# SHIM_ROOT/include mirrors CUDA_ROOT/include by symlinks, except cuda_bf16.h and cuda_fp16.h,
# which include the real header and then map `__powf(2, x)` (how our kernels write 2^x) to
# `ex2.approx.ftz.f32`: one MUFU.EX2 instead of the FSETP, two predicated FMULs and the MUFU that
# NVRTC emits without `--ftz=true`, an option CubeCL does not pass. Subnormal results flush to 0.
# Nothing ships with it: it only quantifies the missing compiler option (docs/perf-notes.md,
# 2026-11-25; docs/perf/archive/h100-ftz-exp2.csv).
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 CUDA_ROOT SHIM_ROOT" >&2; exit 2; }
REAL=$(realpath "$1")/include
rm -rf "$2"
mkdir -p "$2/include"
SHIM=$(realpath "$2")/include
for entry in "$REAL"/*; do ln -s "$entry" "$SHIM/$(basename "$entry")"; done
for header in cuda_bf16.h cuda_fp16.h; do
  rm -f "$SHIM/$header"
  cat >"$SHIM/$header" <<EOF
#include "$REAL/$header"
#ifndef FLASH_FTZ_EXP2_SHIM
#define FLASH_FTZ_EXP2_SHIM
static __device__ __forceinline__ float flash_shim_powf(float base, float x) {
  if (base == 2.0f) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
  }
  return __powf(base, x);
}
#define __powf flash_shim_powf
#endif
EOF
done
