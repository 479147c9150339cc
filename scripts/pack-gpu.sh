#!/usr/bin/env bash
# Build the CUDA test suite, the benchmark and the GPT example here (the GPU machine has no
# Rust), strip and compress them into .gpu/ (git-ignored), ready to be carried to the GPU
# machine, where scripts/gpu-run.sh runs them.
#
#   scripts/pack-gpu.sh       # .gpu/test-suite.xz, .gpu/test-lib.xz, .gpu/bench-attention.xz,
#                             # .gpu/bench-decode.xz, .gpu/bench-varlen.xz, .gpu/gpt.xz
#   scripts/pack-gpu.sh gpt   # only the GPT example, beside what .gpu/ holds
#
# Each binary is ~31 MB compressed (xz with its x86 filter, level 9e): two fit one GPU call's
# 64 MiB beside the tracked files (at level 6 they took ~33 MB each, and two did not).
set -euo pipefail
cd "$(dirname "$0")/.."
# CubeCL 0.12's CUDA runtime links LLVM: Debian's, where the bundler cannot download one.
scripts/llvm-offline.sh >/dev/null
# The executables of a cargo build's JSON messages whose target kind is $1, as "name path" lines.
executables() {
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == [sys.argv[1]]:
        print(m["target"]["name"], m["executable"])
' "$1"
}
# Compress one stripped binary in place (`$1.xz`): the x86 branch filter and a dictionary as
# large as the binary save ~8 % over plain level 6, which decides whether two fit one call.
pack() {
  xz --x86 --lzma2=preset=9e,dict=128MiB -T1 "$1"
}
pack_gpt() {
  rm -f .gpu/gpt .gpu/gpt.xz .gpu/fortunes.tar
  cargo build --release --features cuda,autotune -p gpt --message-format json \
    | executables bin | while read -r name exe; do cp "$exe" ".gpu/$name"; done
  strip .gpu/gpt && pack .gpu/gpt
  # Debian's fortunes, the corpus of docs/gpt.md's runs, where installed here (the GPU machine
  # has none); without them the GPT stages train on the built-in corpus.
  if [ -d /usr/share/games/fortunes ]; then
    tar -cf .gpu/fortunes.tar -C /usr/share/games fortunes
  fi
}
mkdir -p .gpu
if [ "${1:-}" = gpt ]; then
  pack_gpt && ls -la .gpu && exit 0
fi
rm -f .gpu/test-* .gpu/bench-*
# The suite's one test binary (its CUDA tests are the modules `forward_cuda`, `backward_cuda`
# and the CUDA halves of `cache`, `masks` and `reliability`).
cargo test --release --features cuda --test suite --no-run --message-format json \
  | executables test | while read -r name exe; do cp "$exe" ".gpu/test-$name"; done
# The library's own tests, for its CUDA ones (the Hopper tile's products: `TEST_FILTER=cuda`).
cargo test --release --features cuda -p burn-flash --lib --no-run --message-format json \
  | executables lib | while read -r name exe; do cp "$exe" ".gpu/test-lib"; done
# `cargo build --release` rather than `cargo bench`: the bench profile would build every
# dependency a second time.
cargo build --release --features cuda --bench attention --bench decode --bench varlen --message-format json \
  | executables bench | while read -r name exe; do cp "$exe" ".gpu/bench-$name"; done
cp ../shared/tools/torch_sdpa_bench.py .gpu/
strip .gpu/test-* .gpu/bench-*
for f in .gpu/test-* .gpu/bench-*; do pack "$f" & done; wait
pack_gpt
ls -la .gpu
