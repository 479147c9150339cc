#!/usr/bin/env bash
# README's test command: the tests `cargo test` runs (the library's unit and doc tests, the
# integration suite, the GPT example's), built once in the `tests` profile (Cargo.toml: release
# at opt-level 1), then run as two cargo processes side by side. On lavapipe nearly all of their
# time is Mesa compiling the kernels, one kernel at a time per process (a device compiles on its
# server thread), so two processes on two cores take about half the time of one. The first half
# prints as it runs, the second when both are done.
# Arguments go to every cargo command, e.g. `scripts/test.sh --features cuda`.
set -euo pipefail
cd "$(dirname "$0")/.."

# llvmpipe (lavapipe's compiler) without LLVM's optimisation passes: they are about a fifth of a
# cold kernel compile, and at the tests' small shapes the slower kernels cost less than that
# saves (docs/guarantees.md, "The test suite"). Only Mesa's CPU drivers read it; a value already
# in the environment wins.
export GALLIVM_PERF=${GALLIVM_PERF-nopt}

cargo test --profile tests "$@" --no-run

# The suite's backward tests go with the library's, which balances the two halves' cold times.
second_log=$(mktemp)
trap 'rm -f "$second_log"' EXIT
cargo test --profile tests "$@" --test suite -- --skip backward_wgpu >"$second_log" 2>&1 &
second=$!

status=0
cargo test --profile tests "$@" --lib --bins || status=1
cargo test --profile tests "$@" --test suite -- backward_wgpu || status=1
cargo test --profile tests "$@" --doc || status=1

wait "$second" || status=1
cat "$second_log"
exit "$status"
