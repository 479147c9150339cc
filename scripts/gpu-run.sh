#!/usr/bin/env bash
# Runs on the GPU machine (no Rust there), from the repository root, with the binaries that
# scripts/pack-gpu.sh left in .gpu/. Everything it measures goes under $OUT.
#
#   scripts/gpu-run.sh tests   # CUDA tests (TEST_FILTER, default `cuda`; fail loudly without a device)
#   scripts/gpu-run.sh ptests  # the same, one process per test, all at once (TEST_TIMEOUT each;
#                              # PTESTS_NAMES: only those tests)
#   scripts/gpu-run.sh sanitize # compute-sanitizer (SANITIZERS) over the kernels on ragged shapes
#   scripts/gpu-run.sh sources # dump the fused kernels' generated CUDA source (forward, backward)
#   scripts/gpu-run.sh bench   # cargo-bench binary and the torch script, same call, one CSV (TIMING)
#   scripts/gpu-run.sh table   # docs/performance.md's table: forward (also the tile forced) and training step (both dQ) beside the torch script
#   scripts/gpu-run.sh timing  # our forward timed b2b and clear (as do_bench), beside the torch script
#   scripts/gpu-run.sh decode  # KV-cache decoding (bench-decode) beside the torch decode script (DECODE_ARGS)
#   scripts/gpu-run.sh varlen  # packed variable-length batches (bench-varlen) beside the torch varlen script (VARLEN_ARGS)
#   scripts/gpu-run.sh tune    # burn-flash forward per BURN_FLASH_TC_SHAPE in $SHAPES
#   scripts/gpu-run.sh features # issue 6's feature table (FEATURE_MODES, default fwd; BENCH_ARGS)
#   scripts/gpu-run.sh memory  # one training step per impl and length (b1 h16 d128), one process each
#   scripts/gpu-run.sh gpt-curves # examples/gpt, GPT-2 small at context 1024, per attention (GPT_ATTN)
#   scripts/gpu-run.sh gpt-sweep  # tokens/s and memory per context (GPT_CONTEXTS), per attention
#   scripts/gpu-run.sh gpt-multi  # data-parallel on GPT_DEVICES GPUs against one, same machine
#
# Several stages may be given; they run in order.
set -uo pipefail
cd "$(dirname "$0")/.."
# The binaries: those of `scripts/pack-gpu.sh` in `.gpu`, or another folder of them (e.g. the
# same script run at another commit, for the `table` stage's TABLE_BINS).
BIN=${BIN:-.gpu}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
for f in .gpu/*.xz .gpu/*/*.xz; do [ -e "$f" ] && xz -d -f "$f"; done
chmod +x .gpu/test-* .gpu/bench-* .gpu/gpt .gpu/*/* 2>/dev/null
if [ -e .gpu/fortunes.tar ]; then mkdir -p /tmp/corpus && tar -xf .gpu/fortunes.tar -C /tmp/corpus; fi
# CubeCL's autotune results and compiled PTX, kept between calls: a GPT process otherwise spends
# its first five minutes compiling and autotuning Burn's kernels on the CPU. CACHE=1 turns the
# PTX cache on and returns both, xz-compressed in parts of 15 MiB, as
# $OUT/cubecl-cache.tar.xz.part-* (keep them in .gpu/ for the next call).
if [ "${CACHE:-0}" = 1 ]; then
  # CubeCL 0.12 keeps compiled kernels and autotune results in one database under
  # target/environment/ (autotune results there by default).
  printf '[compilation]\ncache = true\n' >cubecl.toml
  if compgen -G '.gpu/cubecl-cache.tar.xz.part-*' >/dev/null; then
    mkdir -p target && cat .gpu/cubecl-cache.tar.xz.part-* | xz -d | tar -xf - -C target
  fi
fi
# The device returns at most 8 files of at most 16 MiB from $OUT: at exit the cache is cut into
# parts, and where more than 8 files remain, all but the CSVs and the cache go into logs.tar.xz.
finish() {
  if [ "${CACHE:-0}" = 1 ]; then
    tar -cf - -C target . | xz -T0 -6 | split -b 15M - "$OUT/cubecl-cache.tar.xz.part-"
  fi
  local all=("$OUT"/*)
  if [ ${#all[@]} -gt 8 ]; then
    local logs
    logs=$(cd "$OUT" && ls | grep -v -e '\.csv$' -e '^cubecl-cache')
    (cd "$OUT" && tar -cJf logs.tar.xz --remove-files $logs)
  fi
}
trap finish EXIT
# GPT-2 small in bf16, the same for every gpt stage: on Debian's fortunes where
# `scripts/pack-gpu.sh` found them (the corpus of docs/gpt.md's runs), else the built-in corpus.
DATA=()
if [ -d /tmp/corpus/fortunes ]; then DATA=(--data /tmp/corpus/fortunes); fi
GPT=($BIN/gpt "${DATA[@]}" --layers 12 --d-model 768 --heads 12 --dtype bf16
  --lr 6e-4 --min-lr 6e-5 --log-every 25)
# A GPT run's time limit: GPT_TIMEOUT, cut so that the script ends by GPT_DEADLINE seconds.
gpt_limit() {
  local left=$(( ${GPT_DEADLINE:-100000} - SECONDS ))
  left=$(( left < ${GPT_TIMEOUT:-300} ? left : ${GPT_TIMEOUT:-300} ))
  echo $(( left < 1 ? 1 : left ))  # never 0: `timeout 0` waits forever
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv >"$OUT/gpu.txt"
cat "$OUT/gpu.txt"

BENCH_D=${BENCH_D:-64,128}
# How the bench, features and tune stages time our rows: `clear`, as the torch script's
# do_bench times PyTorch's (docs/performance.md, "Timing method and the power cap"); BENCH_ARGS
# may override it per call.
TIMING=${TIMING:-clear}
BENCH_N=${BENCH_N:-512,1024,2048,4096,8192,16384}

for stage in "$@"; do
  case "$stage" in
  tests)
    for t in $BIN/test-*; do
      echo "== $t"
      BURN_FLASH_REQUIRE_CUDA=1 "$t" --test-threads 1 ${TEST_FILTER:-cuda} 2>&1 | tee "$OUT/$(basename "$t").log" | tail -25
    done
    ;;
  ptests)
    # Most of a test's time is NVRTC compiles and Burn's autotune (CPU), so the tests overlap
    # well; timings are not taken here. Three rounds: every test at once, then those matching
    # PTESTS_ALONE (the benchmark shapes, whose unfused baselines allocate 5 GB at once) beside
    # each other only, then those matching PTESTS_SERIAL (tensors of more than 2^31 elements:
    # 40 GB and 20 GB of device memory) one at a time: beside the others they run out of memory.
    # Each test's log is appended to $OUT/ptests.log as it ends, and the logs of tests still
    # running when the script is stopped are appended then, marked unfinished, so that a call
    # that hits its time limit still returns every log in one file.
    alone=${PTESTS_ALONE:-benchmark_shapes}
    serial=${PTESTS_SERIAL:-beyond_2_pow_31}
    logs=${PTESTS_LOGS:-/tmp/ptests} && rm -rf "$logs" && mkdir -p "$logs"
    collect_unfinished() {
      for f in "$logs"/*.log; do
        [ -e "$f" ] && { echo "=== $(basename "$f" .log) (unfinished)"; cat "$f"; } >>"$OUT/ptests.log"
      done
    }
    # TERM and INT only: EXIT carries `finish`, which `exit` still runs.
    trap 'collect_unfinished; exit 143' TERM INT
    ptest() {
      local log="$logs/$(basename "$1").${2//::/.}.log"
      ( BURN_FLASH_REQUIRE_CUDA=1 CUBECL_AUTOTUNE_LEVEL=minimal timeout "${TEST_TIMEOUT:-300}" \
          "$1" --exact "$2" --nocapture </dev/null >"$log" 2>&1
        rc=$?  # before any other expansion resets it
        echo "$(basename "$1") $2 rc=$rc" >>"$OUT/ptests.txt"
        { flock 9; echo "=== $(basename "$1") $2 rc=$rc"; cat "$log"; } 9>>"$OUT/ptests.log" \
          >>"$OUT/ptests.log"
        rm -f "$log" )
    }
    # The suite's CUDA tests in round $1 (all, alone, serial); PTESTS_NAMES="a::b c::d" runs
    # exactly those, all at once, in the first round.
    tests_of() {
      if [ -n "${PTESTS_NAMES:-}" ]; then
        [ "$1" = all ] && for name in $PTESTS_NAMES; do echo "$BIN/test-suite $name"; done
        return 0
      fi
      for t in $BIN/test-*; do
        for name in $("$t" --list ${TEST_FILTER:-cuda} 2>/dev/null | sed -n 's/: test$//p'); do
          case "$1" in
          all) [[ $name == *$alone* || $name == *$serial* ]] || echo "$t $name" ;;
          alone) [[ $name == *$alone* && $name != *$serial* ]] && echo "$t $name" ;;
          serial) [[ $name == *$serial* ]] && echo "$t $name" ;;
          esac
        done
      done
    }
    for round in all alone; do
      while read -r t name; do ptest "$t" "$name" & done < <(tests_of $round)
      wait
    done
    while read -r t name; do ptest "$t" "$name"; done < <(tests_of serial)
    trap - TERM INT
    sort "$OUT/ptests.txt"
    ;;
  sanitize)
    # compute-sanitizer over every fused kernel on ragged shapes (the tests below launch the
    # forward and both backward dQ modes, the forward's mask packing and staging, and its
    # per-sequence lengths and pages, and packed sequences), one process per tool, all at once;
    # exit code 9 means the tool reported an error. SANITIZE_TESTS: other tests instead, of
    # SANITIZE_BIN (default test-suite; test-lib for the Hopper forward's own tests,
    # `SANITIZE_BIN=test-lib SANITIZE_TESTS=kernel::tests::hopper::warpgroup_forward_matches_the_reference_cuda`).
    tests=${SANITIZE_TESTS:-reliability::cuda::sanitizer_shapes_cuda masks::cuda::boolean_masks_cuda lengths::cuda::sanitizer_shapes_lengths_cuda varlen::cuda::sanitizer_shapes_varlen_cuda}
    for tool in ${SANITIZERS:-memcheck racecheck synccheck initcheck}; do
      ( BURN_FLASH_REQUIRE_CUDA=1 CUBECL_AUTOTUNE_LEVEL=minimal timeout "${SANITIZE_TIMEOUT:-400}" \
          compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 50 \
          $BIN/${SANITIZE_BIN:-test-suite} --exact $tests --test-threads 1 --nocapture \
          >"$OUT/sanitizer-$tool.log" 2>&1
        rc=$?
        echo "sanitizer $tool rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' \
          "$OUT/sanitizer-$tool.log" | tr '\n' ' ')" >>"$OUT/sanitizer.txt" ) &
    done
    wait
    cat "$OUT/sanitizer.txt"
    ;;
  sources)
    # The fused kernels' generated CUDA source, for register/spill checks where ptxas is.
    CUBECL_DEBUG_LOG="$OUT/cubecl.log" $BIN/bench-attention --impls burn-flash --d "$BENCH_D" \
      --n 256 --iters 1 --warmup 0 --causal both --modes fwd,fwdbwd >/dev/null 2>&1
    python3 - "$OUT/cubecl.log" "$OUT" <<'EOF'
import re, sys, pathlib
log = pathlib.Path(sys.argv[1]).read_text(errors="replace")
out = pathlib.Path(sys.argv[2])
blocks = re.findall(r"\[START_KERNEL_COMPILATION\](.*?)\[END_KERNEL_COMPILATION\]", log, re.S)
count = {}
for block in blocks:
    name = next((k for k in ("flash_forward", "key_value_grads", "query_grads") if k in block), None)
    if name is None or "__global__" not in block:
        continue
    n = count[name] = count.get(name, -1) + 1
    start = block.index("#include")
    (out / f"{name}_{n}.meta").write_text(block[:start])
    (out / f"{name}_{n}.cu").write_text(block[start:].rstrip().removesuffix("```"))
print(f"fused kernel sources: {count}")
EOF
    rm -f "$OUT/cubecl.log"
    ;;
  features)
    # Issue 6's table: plain attention and each feature, back to back in one process each,
    # bf16, d 64/128, n 2048/8192, causal and not; then GQA and a sliding window.
    B=$BIN/bench-attention
    {
      # Plain rows first and last: the table compares each feature with their mean.
      for extra in "" "--mask keypad" "--mask full" "--bias heads" "--alibi" "--dropout 0.1" \
          "--softcap 30" ""; do
        $B --impls burn-flash --d 64,128 --n 2048,8192 --causal both \
          --modes "${FEATURE_MODES:-fwd}" --iters 10 --timing "$TIMING" $extra ${BENCH_ARGS:-}
      done
      $B --impls burn-flash --h 32 --hkv 8 --d 128 --n 2048,8192 --causal both \
        --modes "${FEATURE_MODES:-fwd}" --iters 10 --timing "$TIMING" ${BENCH_ARGS:-}
      $B --impls burn-flash --window 1024 --d 128 --n 8192,16384 --causal both \
        --modes "${FEATURE_MODES:-fwd}" --iters 10 --timing "$TIMING" ${BENCH_ARGS:-}
    } 2>"$OUT/features.err" | awk '/^impl,/ { if (seen++) next } !/^#/' | tee "$OUT/features.csv"
    ;;
  bench)
    # PyTorch first, so that our summary (the '#' lines after our CSV) includes its rows.
    python3 .gpu/torch_sdpa_bench.py --d "$BENCH_D" --n "$BENCH_N" --causal both \
      --backends flash,cudnn --modes "${TORCH_MODES:-fwd}" 2>"$OUT/torch.err" | tee "$OUT/torch.csv"
    $BIN/bench-attention --d "$BENCH_D" --n "$BENCH_N" --causal both --peers "$OUT/torch.csv" \
      --timing "$TIMING" ${BENCH_ARGS:-} 2>"$OUT/bench.err" | tee "$OUT/bench.csv"
    { awk '/^# summary/ { exit } { print }' "$OUT/bench.csv"; grep -v '^impl,' "$OUT/torch.csv"; } \
      >"$OUT/h100.csv"
    sed -n '/^# summary/,$p' "$OUT/bench.csv" >"$OUT/summary.txt"
    ;;
  table)
    # docs/performance.md's table: burn-flash's forward and training step, the latter also with
    # the atomic dQ, beside PyTorch's backends, one CSV per folder of binaries in TABLE_BINS
    # (default BIN; give two to set builds side by side). Burn's built-in attention is left to
    # a call of its own: its first call per shape autotunes for minutes (docs/perf-notes.md,
    # 2026-11-28).
    python3 .gpu/torch_sdpa_bench.py --d "$BENCH_D" --n "$BENCH_N" --causal both \
      --backends flash,cudnn --modes fwd,fwdbwd 2>"$OUT/torch.err" | tee "$OUT/torch.csv"
    for bin in ${TABLE_BINS:-$BIN}; do
      tag=$(basename "$bin")
      {
        $bin/bench-attention --impls burn-flash --d "$BENCH_D" --n "$BENCH_N" --causal both \
          --modes fwd,fwdbwd --timing "$TIMING" ${BENCH_ARGS:-}
        $bin/bench-attention --impls burn-flash --d "$BENCH_D" --n "$BENCH_N" --causal both \
          --modes fwdbwd --atomic-dq --timing "$TIMING" ${BENCH_ARGS:-}
        # The tensor-core tile forced (the SM80 path; on SM90 the Hopper forward is the default
        # over long keys), its rows named burn-flash-tile.
        BURN_FLASH_WARPGROUP=0 $bin/bench-attention --impls burn-flash --d "$BENCH_D" \
          --n "$BENCH_N" --causal both --modes fwd --timing "$TIMING" ${BENCH_ARGS:-} \
          | sed 's/^burn-flash,/burn-flash-tile,/'
      } 2>"$OUT/$tag.err" | grep -v '^#' | awk '/^impl,/ { if (seen++) next } { print }' \
        | tee "$OUT/$tag.csv"
    done
    ;;
  decode)
    # Decoding against a KV cache: PyTorch's backends and ours on the same shapes, same call
    # (DECODE_ARGS: the flags both programs take, --b --sk --hkv --hq --sq --d --max-cache-gib
    # --clear).
    # DECODE_VARIANTS: space-separated settings our rows run under, each `plan` (the plan's
    # choices) or comma-separated VAR=value pairs (e.g. BURN_FLASH_KV_SPLITS=1,BURN_FLASH_PACK_GROUPS=0);
    # all in one decode.csv, the setting in its first column. DECODE_IMPLS: our bench's
    # implementations (default burn-flash; burn-unfused is slow on the long caches).
    # DECODE_FLAGS: space-separated sets of our bench's own flags, each run in turn, `none` for
    # the dense call (e.g. `none --key-lengths --page-size=256`: the per-sequence and paged
    # paths, their rows named burn-flash-lengths and burn-flash-paged).
    python3 scripts/torch_decode_bench.py ${DECODE_ARGS:-} 2>"$OUT/torch-decode.err" \
      | tee "$OUT/torch-decode.csv"
    echo "variant,impl,dtype,b,hq,hkv,sq,sk,d,ms,gbps" >"$OUT/decode.csv"
    for variant in ${DECODE_VARIANTS:-plan}; do
      vars=(); [ "$variant" = plan ] || IFS=, read -ra vars <<<"$variant"
      for flags in ${DECODE_FLAGS:-none}; do
        own=(); [ "$flags" = none ] || IFS=, read -ra own <<<"$flags"
        echo "# $variant $flags" >>"$OUT/decode.err"
        env "${vars[@]}" timeout "${DECODE_TIMEOUT:-600}" $BIN/bench-decode \
          --impls "${DECODE_IMPLS:-burn-flash}" ${DECODE_ARGS:-} "${own[@]}" \
          2>>"$OUT/decode.err" | grep -v '^impl,' | sed "s/^/${variant//,/+},/" \
          | tee -a "$OUT/decode.csv"
      done
    done
    ;;
  varlen)
    # Variable-length batches: PyTorch's nested-tensor flash attention and its padded backends,
    # and ours packed and padded, same call (VARLEN_ARGS: the flags both programs take, --mean
    # --tokens --d --h --causal --modes --seed --iters).
    python3 scripts/torch_varlen_bench.py ${VARLEN_ARGS:-} 2>"$OUT/torch-varlen.err" \
      | tee "$OUT/torch-varlen.csv"
    timeout "${VARLEN_TIMEOUT:-400}" $BIN/bench-varlen ${VARLEN_ARGS:-} 2>"$OUT/varlen.err" \
      | tee "$OUT/varlen.csv"
    ;;
  timing)
    # The bench's two timing methods against each other (docs/performance.md, "Timing method
    # and the power cap"): our forward b2b and clear, one process each, interleaved over two
    # rounds, beside the torch script's rows of the same shapes; then Burn's unfused forward
    # beside ours, timed clear (issue 2's d 128 bar). One CSV, the method in the first column;
    # the clear's own time per row is in timing.err.
    TIMING_D=${TIMING_D:-64,128} TIMING_N=${TIMING_N:-2048,8192}
    echo "method,impl,dtype,b,h,hkv,n,d,causal,mode,ms,tflops" | tee "$OUT/timing.csv"
    {
      python3 .gpu/torch_sdpa_bench.py --d "$TIMING_D" --n "$TIMING_N" --causal both \
        --backends flash --modes fwd 2>>"$OUT/timing.err" | sed 's/^/do_bench,/'
      for round in 1 2; do
        for method in b2b clear; do
          $BIN/bench-attention --impls burn-flash --d "$TIMING_D" --n "$TIMING_N" --causal both \
            --modes fwd --iters 10 --timing $method 2>>"$OUT/timing.err" | sed "s/^/$method,/"
        done
      done
      $BIN/bench-attention --impls burn-unfused,burn-flash --d 128 --n 2048,4096,8192 \
        --causal false --modes fwd --timing clear 2>>"$OUT/timing.err" | sed 's/^/clear,/'
    } | grep -v ',#\|,impl,' | tee -a "$OUT/timing.csv"
    ;;
  tune)
    for shape in ${SHAPES:-4,32,64}; do
      echo "# BURN_FLASH_TC_SHAPE=$shape"
      BURN_FLASH_TC_SHAPE=$shape $BIN/bench-attention --impls burn-flash --d "$BENCH_D" \
        --n "$BENCH_N" --causal both --iters 20 --timing "$TIMING" 2>>"$OUT/tune.err" | sed "s/^burn-flash,/burn-flash[$shape],/"
    done | tee -a "$OUT/tune.csv"
    ;;
  memory)
    # A process per row: the pools' high-water mark is per process, and an unfused step that
    # runs out of memory must not take the next row with it.
    : >"$OUT/memory.raw"
    for impl in ${MEM_IMPLS:-burn-flash burn-unfused}; do
      for n in ${MEM_N:-4096 16384 32768}; do
        timeout "${MEM_TIMEOUT:-150}" $BIN/bench-attention --memory --impls "$impl" --b 1 --h 16 \
          --d 128 --n "$n" --causal "${MEM_CAUSAL:-false}" >>"$OUT/memory.raw" 2>>"$OUT/memory.err" \
          || echo "# $impl n=$n exited $?" >>"$OUT/memory.raw"
      done
    done
    awk 'NR == 1 || !/^impl,/' "$OUT/memory.raw" | tee "$OUT/memory.csv"
    ;;
  gpt-curves)
    # The same seed and configuration under each attention: the loss curves.
    for a in ${GPT_ATTN:-flash burn unfused}; do
      timeout "$(gpt_limit)" "${GPT[@]}" --attention "$a" --context 1024 --batch 16 \
        --steps "${GPT_STEPS:-300}" --warmup 30 --eval-every 25 --eval-batches 8 \
        --csv "$OUT/gpt-curve-$a.csv" >"$OUT/gpt-curve-$a.log" 2>&1
      echo "$a rc=$? $(grep '^summary' "$OUT/gpt-curve-$a.log")" | tee -a "$OUT/gpt-curves.txt"
    done
    ;;
  gpt-sweep)
    # 16384 tokens per step at every context (the batch shrinks as it grows, down to 1); an
    # attention stops at its first failure (out of memory, or the time limit).
    for a in ${GPT_ATTN:-flash burn unfused}; do
      for cb in ${GPT_CONTEXTS:-1024:16 2048:8 4096:4 8192:2 16384:1 32768:1 65536:1}; do
        timeout "$(gpt_limit)" "${GPT[@]}" --attention "$a" --context "${cb%:*}" \
          --batch "${cb#*:}" --steps 25 --warmup 5 --eval-batches 0 \
          --sample-len 0 >"$OUT/gpt-sweep-$a-${cb%:*}.log" 2>&1
        rc=$?
        echo "$a ${cb%:*}x${cb#*:} rc=$rc $(grep '^summary' "$OUT/gpt-sweep-$a-${cb%:*}.log")" \
          | tee -a "$OUT/gpt-sweep.txt"
        [ $rc -eq 0 ] || break
      done
    done
    ;;
  gpt-multi)
    # Burn's multi-device step moves tensors between GPUs through NCCL, which cudarc opens as
    # libnccl.so: PyTorch's copy serves.
    nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__path__[0]) + "/nccl/lib")' 2>/dev/null)
    [ -n "$nccl" ] || nccl=$(dirname "$(ldconfig -p | awk '/libnccl\.so/ { print $NF; exit }')")
    mkdir -p /tmp/nccl && ln -sf "$(ls "$nccl"/libnccl.so* | head -1)" /tmp/nccl/libnccl.so
    export LD_LIBRARY_PATH=/tmp/nccl:$LD_LIBRARY_PATH
    for db in ${GPT_MULTI:-1:16 2:32 2:16}; do
      timeout "$(gpt_limit)" "${GPT[@]}" --attention flash --context 1024 \
        --devices "${db%:*}" --batch "${db#*:}" --steps "${GPT_STEPS:-100}" --warmup 10 \
        --eval-every 50 --eval-batches 4 --csv "$OUT/gpt-multi-${db/:/x}.csv" \
        >"$OUT/gpt-multi-${db/:/x}.log" 2>&1
      echo "devices ${db%:*} batch ${db#*:} rc=$? $(grep '^summary' "$OUT/gpt-multi-${db/:/x}.log")" \
        | tee -a "$OUT/gpt-multi.txt"
    done
    ;;
  profile)
    # One launch of each kernel after a warm-up step, full section set, clocks left alone
    # (METHOD.md). PROF_N sets the length (b = 16384 / n, h = 2048 / d as in the bench),
    # PROF_CAUSAL the mask (false), PROF_KERNELS our kernels' regex, PROF_ARGS more bench flags;
    # e.g. the Hopper backward: BURN_FLASH_WARPGROUP_BACKWARD=1 PROF_ARGS=--atomic-dq
    # PROF_KERNELS=warpgroup_key_value_grads PROF_CAUSAL=true.
    n=${PROF_N:-4096}
    for d in ${PROF_D:-64 128}; do
      ncu --clock-control none --set full --import-source no -f -o "$OUT/ours-d$d" \
        --kernel-name regex:"${PROF_KERNELS:-flash_forward|key_value_grads|query_grads}" \
        --launch-skip 3 --launch-count 3 $BIN/bench-attention --impls burn-flash --modes fwdbwd \
        --d "$d" --n "$n" --causal "${PROF_CAUSAL:-false}" --iters 2 --warmup 1 ${PROF_ARGS:-} \
        >"$OUT/ours-d$d.log" 2>&1
      ncu --clock-control none --set full --import-source no -f -o "$OUT/fa2-d$d" \
        --kernel-name regex:'flash_fwd_kernel|flash_bwd_dq_dk_dv' --launch-skip 2 \
        --launch-count 2 python3 scripts/ab/fa2-step.py "$d" "$n" >"$OUT/fa2-d$d.log" 2>&1
      for r in ours fa2; do
        ncu -i "$OUT/$r-d$d.ncu-rep" --page details --print-units base >"$OUT/$r-d$d.details.txt" 2>&1
        ncu -i "$OUT/$r-d$d.ncu-rep" --page raw --csv >"$OUT/$r-d$d.raw.csv" 2>&1
        ncu -i "$OUT/$r-d$d.ncu-rep" --page source --print-source sass --csv >"$OUT/$r-d$d.sass.csv" 2>&1
      done
    done
    ls -la "$OUT"
    ;;
  *)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
  esac
done
