#!/usr/bin/env bash
# The fused kernels' CUDA source as CubeCL generates it for an H100, without a GPU
# (crates/burn-flash/examples/kernel_sources.rs), then registers, spills and SASS size of each from NVRTC + ptxas
# (scripts/profile/ptxas/compile.sh; its .sass files go to scripts/profile/ptxas/out/).
#
#   scripts/profile/kernel-sources.sh OUTDIR [--d 64,128]
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 OUTDIR [--d 64,128]" >&2; exit 2; }
cd "$(dirname "$0")/../.."
cargo run --release --features cuda -p burn-flash --example kernel_sources -- "$@"
shopt -s nullglob
kernels=("$1"/flash_forward*.cu "$1"/key_value_grads*.cu "$1"/query_grads*.cu "$1"/row_dot*.cu
  "$1"/warpgroup_*.cu)
scripts/profile/ptxas/compile.sh "${kernels[@]}"
