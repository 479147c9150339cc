#!/usr/bin/env bash
# Build the CUDA test and benchmark binaries here (the GPU machine has no Rust), strip and
# compress them into .gpu/ (git-ignored), ready to be carried to the GPU machine, where
# scripts/gpu-run.sh runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu
# The suite's one test binary (its CUDA tests are the modules `forward_cuda`, `backward_cuda`).
cargo test --release --features cuda --test suite --no-run \
  --message-format json \
  | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do
  cp "$exe" ".gpu/test-$name"
done
cargo bench --features cuda --no-run --message-format json \
  | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["bench"]:
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do cp "$exe" ".gpu/bench-$name"; done
cp ../shared/tools/torch_sdpa_bench.py .gpu/
strip .gpu/test-* .gpu/bench-* 2>/dev/null || true
xz -T2 -6 .gpu/test-* .gpu/bench-*
ls -la .gpu
