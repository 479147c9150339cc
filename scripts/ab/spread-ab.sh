#!/usr/bin/env bash
# A/B of two bench binaries over fresh processes, interleaved (scripts/ab/layout-spread.py per
# process, so each row carries that process's shared-memory layout of the forward).
#
#   scripts/ab/spread-ab.sh ROUNDS OLD NEW -- BENCH_ARGS...   (writes CSV to stdout)
set -uo pipefail
rounds=$1 old=$2 new=$3; shift 4
echo "binary,round,process,layout,impl,dtype,b,h,hkv,n,d,causal,mode,ms,tflops"
for r in $(seq "$rounds"); do
  for side in old new; do
    bin=${!side}
    python3 "$(dirname "$0")/layout-spread.py" "$bin" 1 "${OUT:-/tmp/out}/layouts-$side" -- "$@" \
      | sed "1d;s/^/$side,$r,/"
  done
done
