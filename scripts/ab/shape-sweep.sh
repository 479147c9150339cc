#!/usr/bin/env bash
# Block-shape sweep: one bench process per (override, head dim), each row labelled with the
# override it ran under ("base" = the built-in shapes), rounds interleaved so that the card's
# drift shows as spread rather than as a winner. The overrides are the launch's tuning
# variables (BURN_FLASH_TC_SHAPE, BURN_FLASH_BWD_SHAPE, BURN_FLASH_BWD_SPLIT, BURN_FLASH_DQ_SHAPE).
#
#   scripts/ab/shape-sweep.sh ROUNDS MODE D SPEC...  (SPEC: base | VAR=value[;VAR=value])
#   e.g. scripts/ab/shape-sweep.sh 2 fwdbwd 64 base BURN_FLASH_DQ_SHAPE=4,16,64
set -uo pipefail
rounds=$1 mode=$2 d=$3; shift 3
B=${BENCH:-.gpu/bench-attention}
for r in $(seq "$rounds"); do
  for spec in "$@"; do
    env_args=()
    [ "$spec" = base ] || IFS=';' read -ra env_args <<<"$spec"
    env "${env_args[@]}" timeout 120 "$B" --impls burn-flash --d "$d" --n "${SWEEP_N:-2048,8192}" \
      --causal both --modes "$mode" --iters "${SWEEP_ITERS:-10}" --timing clear 2>/dev/null \
      | grep '^burn-flash,' | sed "s/^/$r,\"$spec\",/"
  done
done
