#!/usr/bin/env bash
# A/B of bench binaries and tuning environments: one process per (round, spec), the specs
# interleaved within each round so that clock and thermal drift fall on all of them alike.
# A spec is words `VAR=value` (or `base` for none), optionally `@PATH` (another bench binary
# than BENCH, e.g. the previous tree's), then optional bench flags after a `|`, e.g.
# "BURN_FLASH_BWD_SPLIT=1", "@.gpu/bench-old base", "BURN_FLASH_DQ_ATOMIC=1 | --atomic-dq".
#
#   ROUNDS=2 scripts/ab/env-ab.sh BENCH SPEC... -- BENCH_ARGS...   (writes CSV to stdout)
#
# AB_COLUMNS: the bench's CSV columns after round and spec (default bench-attention's).
set -uo pipefail
default_bench=$1 && shift
specs=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do specs+=("$1") && shift; done
shift
echo "round,spec,${AB_COLUMNS:-impl,dtype,b,h,hkv,n,d,causal,mode,ms,tflops}"
for round in $(seq "${ROUNDS:-2}"); do
  for spec in "${specs[@]}"; do
    words=${spec%%|*} flags= vars=() bench=$default_bench
    [[ $spec == *"|"* ]] && flags=${spec#*|}
    for word in $words; do
      case "$word" in
      @*) bench=${word#@} ;;
      base) ;;
      *) vars+=("$word") ;;
      esac
    done
    # shellcheck disable=SC2086 # the flags of a spec are meant to split
    env "${vars[@]}" "$bench" "$@" $flags | grep -v '^#\|^impl,' \
      | awk -v prefix="$round,\"$spec\"," '{ print prefix $0 }'
  done
done
