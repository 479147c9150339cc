#!/usr/bin/env bash
# Reproduce CubeCL's NVRTC compile of the generated kernels and get ptxas -v numbers.
#
#   scripts/profile/ptxas/compile.sh out/flash_forward_*.cu   (sources from `scripts/profile/kernel-sources.sh`,
#                                                     no GPU, or `scripts/gpu-run.sh sources`)
#
# Registers, spills, stack and code size of generated kernels without a GPU: the same NVRTC
# compile CubeCL does, then ptxas -v, from pip wheels in scripts/profile/ptxas/venv (git-ignored).
#
# env:  TOOLKIT=cu13 (default; CUDA 13.0.88 NVRTC+ptxas, matches the target's CUDA 13.0)
#       TOOLKIT=cu12 (CUDA 12.9.86 NVRTC+ptxas)
#       ARCH=sm_90a  (default)
#
# Pipeline per file (same as CubeCL): strip trailing "```" fence ->
#   NVRTC (--gpu-architecture=$ARCH --include-path=... -lineinfo) -> PTX ->
#   ptxas -arch=$ARCH -c -v -lineinfo -> cubin -> cuobjdump -sass (instruction count)
# `-c`: relocatable code, as the driver assembles CubeCL's PTX (cuLinkAddData); there ptxas
# serialises every wgmma of a kernel that calls a subroutine (C7509), which a whole-program
# compile hides. Its performance notes (C75xx) are printed under the kernel's line.
# Outputs go to out/$TOOLKIT-$ARCH/: .ptx, .cubin, .sass, .nvrtc.log, .ptxas.log
#
# One-time setup (what was used):
#   python3 -m venv venv
#   venv/bin/pip install nvidia-cuda-nvcc-cu12 nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 nvidia-cuda-cccl-cu12
#   venv/bin/pip install nvidia-cuda-nvcc==13.0.88 nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 \
#       nvidia-cuda-cccl==13.0.85 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
#       nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
set -euo pipefail
FILES=()
for f in "$@"; do FILES+=("$(realpath "$f")"); done
[ ${#FILES[@]} -gt 0 ] || { echo "usage: $0 kernel.cu..." >&2; exit 2; }
cd "$(dirname "$0")"
TOOLKIT=${TOOLKIT:-cu13}
ARCH=${ARCH:-sm_90a}
NV=venv/lib/python3.11/site-packages/nvidia
CUOBJDUMP=$NV/cu13/bin/cuobjdump   # 13.x cuobjdump handles sm_90 cubins from either toolkit

case $TOOLKIT in
  cu13)
    LIBNVRTC=$NV/cu13/lib/libnvrtc.so.13
    PTXAS=$NV/cu13/bin/ptxas
    INCS=("$NV/cu13/include" "$NV/cu13/include/cccl")
    ;;
  cu12)
    LIBNVRTC=$NV/cuda_nvrtc/lib/libnvrtc.so.12
    PTXAS=$NV/cuda_nvcc/bin/ptxas
    # crt/mma.h (included by mma.h) ships in the nvcc wheel, not the runtime wheel
    INCS=("$NV/cuda_runtime/include" "$NV/cuda_nvcc/include" "$NV/cuda_cccl/include")
    ;;
  *) echo "unknown TOOLKIT=$TOOLKIT" >&2; exit 1 ;;
esac

export LD_LIBRARY_PATH="$(dirname "$LIBNVRTC")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # for libnvrtc-builtins
OUT=out/$TOOLKIT-$ARCH
mkdir -p "$OUT"

printf '%-8s %-6s %5s %12s %11s %6s %8s %10s\n' file tk regs spill_st_B spill_ld_B stack sass_ins text_bytes
for src in "${FILES[@]}"; do
  b=$(basename "$src" .cu)
  venv/bin/python nvrtc_ptx.py "$LIBNVRTC" "$src" "$OUT/$b.ptx" "$ARCH" "${INCS[@]}" \
      2> "$OUT/$b.nvrtc.log" || { echo "NVRTC failed for $src:"; grep -v 'warning\|^ *\^\|^ *const\|^$' "$OUT/$b.nvrtc.log" | head -40; continue; }
  "$PTXAS" -arch="$ARCH" -c -v -lineinfo "$OUT/$b.ptx" -o "$OUT/$b.cubin" > "$OUT/$b.ptxas.log" 2>&1
  "$CUOBJDUMP" -sass "$OUT/$b.cubin" > "$OUT/$b.sass" 2>/dev/null
  regs=$(grep -oP 'Used \K[0-9]+(?= registers)' "$OUT/$b.ptxas.log")
  st=$(grep -oP '[0-9]+(?= bytes spill stores)' "$OUT/$b.ptxas.log")
  ld=$(grep -oP '[0-9]+(?= bytes spill loads)' "$OUT/$b.ptxas.log")
  stack=$(grep -oP '[0-9]+(?= bytes stack frame)' "$OUT/$b.ptxas.log")
  # SASS instructions = lines with an address comment /*0000*/ (includes trailing NOP/BRA padding)
  nins=$(grep -cP '^\s+/\*[0-9a-f]{4,}\*/' "$OUT/$b.sass")
  text=$(( 16#$(readelf -SW "$OUT/$b.cubin" 2>/dev/null | grep -v '\.text\.__' | grep -oP '\.text\.\S+\s+PROGBITS\s+\S+\s+\S+\s+\K[0-9a-f]+' | head -1) ))
  printf '%-8s %-6s %5s %12s %11s %6s %8s %10s\n' "$b" "$TOOLKIT" "$regs" "$st" "$ld" "$stack" "$nins" "$text"
  grep -oP '\(C75\d\d\).*' "$OUT/$b.ptxas.log" | sed 's/^/    /' || true
done
