#!/usr/bin/env bash
# A/B of decode settings beside cuDNN, on the GPU machine: cuDNN's rows of every shape group
# (scripts/torch_decode_bench.py --backends cudnn) before and after ours, and ours one fresh
# process per (shape group, round, spec) through env-ab.sh, the specs interleaved within each
# round. A shape group is one quoted set of the flags both programs take; a spec is as
# env-ab.sh's (`base`, or `VAR=value` words such as `BURN_FLASH_KV_STAGES=3`). Every call is
# timed `--clear read` (docs/performance.md, "Decoding against a KV cache").
#
#   ROUNDS=2 scripts/ab/decode-ab.sh BENCH_DECODE SPEC... -- GROUP...   (writes CSV to stdout)
#
# e.g. the run of docs/perf/archive/h200-decode-key-blocks-2026-12-03.csv (ab-key-blocks):
#   scripts/ab/decode-ab.sh .gpu/bench-decode base BURN_FLASH_KV_STAGES=2 \
#     "BURN_FLASH_DECODE_BLOCK_KV=32 BURN_FLASH_KV_STAGES=3" \
#     "BURN_FLASH_DECODE_BLOCK_KV=32 BURN_FLASH_KV_STAGES=2" -- \
#     "--b 64 --sk 4096,16384 --hkv 32,8" "--b 8 --sk 4096,16384 --hkv 32" \
#     "--b 1 --sk 131072 --hkv 4" "--b 8 --sk 16384 --hkv 4"
set -uo pipefail
bench=$1 && shift
specs=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do specs+=("$1") && shift; done
shift
here=$(dirname "$0")
columns=impl,dtype,b,hq,hkv,sq,sk,d,ms,gbps
cudnn() {
  for group in "$@"; do
    # shellcheck disable=SC2086 # a group's flags are meant to split
    python3 "$here/../torch_decode_bench.py" --backends cudnn $group --clear read \
      | grep -v '^impl,' | sed "s/^/$when,cudnn,/"
  done
}
echo "round,spec,$columns"
when=before cudnn "$@"
for group in "$@"; do
  # shellcheck disable=SC2086
  AB_COLUMNS=$columns "$here/env-ab.sh" "$bench" "${specs[@]}" -- --impls burn-flash $group \
    --clear read | tail -n +2
done
when=after cudnn "$@"
