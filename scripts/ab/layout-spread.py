#!/usr/bin/env python3
"""Does our forward's speed follow the shared-memory layout CubeCL picks for it?

CubeCL 0.10 places a kernel's shared memories in hash-set order, so each process compiles the
forward with its own layout (and ptxas emits different code for some). This runs the bench
binary in PROCS fresh processes, each with CUBECL_DEBUG_LOG, and prints one CSV row per
process and shape: the forward's layout (`name@offset` of each shared memory, ordered by name)
beside its time. The distinct sources go to OUT/layouts/ for ptxas.

    scripts/ab/layout-spread.py BENCH PROCS OUT -- BENCH_ARGS...
"""
import os, pathlib, re, subprocess, sys

bench, procs, out = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3])
args = sys.argv[sys.argv.index("--") + 1 :]
(out / "layouts").mkdir(parents=True, exist_ok=True)
print("process,layout,impl,dtype,b,h,hkv,n,d,causal,mode,ms,tflops", flush=True)
for p in range(procs):
    log = pathlib.Path(f"/tmp/spread-{p}.log")
    log.unlink(missing_ok=True)
    env = dict(os.environ, CUBECL_DEBUG_LOG=str(log))
    run = subprocess.run([bench, *args], env=env, capture_output=True, text=True)
    text = log.read_text(errors="replace") if log.exists() else ""
    layouts = []
    for block in re.findall(r"\[START_KERNEL_COMPILATION\](.*?)\[END_KERNEL_COMPILATION\]", text, re.S):
        if "flash_forward" not in block or "__global__" not in block:
            continue
        slots = re.findall(r"(shared_memory_\d+)[^;\n]*dynamic_shared_mem\[(\d+)\]", block)
        sig = " ".join(f"{n}@{o}" for n, o in sorted(slots, key=lambda s: int(s[0].split("_")[-1])))
        layouts.append(sig)
        src = block[block.index("#include") :] if "#include" in block else block
        name = "fwd-" + re.sub(r"[^0-9@]+", "_", sig).strip("_") + ".cu"
        (out / "layouts" / name).write_text(src)
    sig = " | ".join(dict.fromkeys(layouts)) or "none"
    rows = [l for l in run.stdout.splitlines() if l.startswith("burn-")]
    if not rows:
        print(f"{p},{sig},FAILED rc={run.returncode} {run.stderr[-300:]!r}", flush=True)
    for row in rows:
        print(f"{p},{sig},{row}", flush=True)
    log.unlink(missing_ok=True)
