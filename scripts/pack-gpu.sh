#!/usr/bin/env bash
# Build the CUDA test and benchmark binaries here (the GPU machine has no Rust), strip and
# compress them into .gpu/ (git-ignored), ready to be carried to the GPU machine, where
# scripts/gpu-run.sh runs them.
#
#   scripts/pack-gpu.sh       # tests, benchmarks and the GPT example
#   scripts/pack-gpu.sh gpt   # only the GPT example, beside what .gpu/ holds
#   scripts/pack-gpu.sh next  # next/'s (Burn 0.23) CUDA suite, bench and GPT example into
#                             # .gpu/next/, beside what .gpu/ holds (run them with
#                             # BIN=.gpu/next scripts/gpu-run.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
pack_gpt() {
  cargo build --release --features cuda -p gpt
  rm -f .gpu/gpt.xz .gpu/fortunes.tar
  cp target/release/gpt .gpu/gpt && strip .gpu/gpt && xz -T2 -6 .gpu/gpt
  # Debian's fortunes, the corpus of docs/gpt.md's runs, where installed here (the GPU machine
  # has none); without them the GPT stages train on the built-in corpus.
  if [ -d /usr/share/games/fortunes ]; then
    tar -cf .gpu/fortunes.tar -C /usr/share/games fortunes
  fi
}
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
pack_next() {
  # CubeCL 0.12's CUDA runtime links LLVM: Debian's, where the bundler cannot download one.
  scripts/llvm-offline.sh >/dev/null
  rm -rf .gpu/next && mkdir -p .gpu/next
  (cd next && cargo test --release --features cuda --test suite --no-run --message-format json) \
    | executables test | while read -r name exe; do cp "$exe" ".gpu/next/test-$name"; done
  # `cargo build --release` rather than `cargo bench`: the bench profile would build every
  # dependency a second time.
  (cd next && cargo build --release --features cuda --bench attention --message-format json) \
    | executables bench | while read -r name exe; do cp "$exe" ".gpu/next/bench-$name"; done
  (cd next && cargo build --release --features cuda -p gpt --message-format json) \
    | executables bin | while read -r name exe; do cp "$exe" ".gpu/next/$name"; done
  cp ../shared/tools/torch_sdpa_bench.py .gpu/
  strip .gpu/next/*
  xz -T2 -6 .gpu/next/*
}
if [ "${1:-}" = next ]; then
  mkdir -p .gpu && pack_next && ls -la .gpu .gpu/next && exit 0
fi
if [ "${1:-}" = gpt ]; then
  mkdir -p .gpu && pack_gpt && ls -la .gpu && exit 0
fi
rm -rf .gpu && mkdir -p .gpu
# The suite's one test binary (its CUDA tests are the modules `forward_cuda`, `backward_cuda`).
cargo test --release --features cuda --test suite --no-run --message-format json \
  | executables test | while read -r name exe; do cp "$exe" ".gpu/test-$name"; done
cargo bench --features cuda --no-run --message-format json \
  | executables bench | while read -r name exe; do cp "$exe" ".gpu/bench-$name"; done
cp ../shared/tools/torch_sdpa_bench.py .gpu/
strip .gpu/test-* .gpu/bench-* 2>/dev/null || true
xz -T2 -6 .gpu/test-* .gpu/bench-*
pack_gpt
ls -la .gpu
