#!/usr/bin/env python3
"""Markdown tables of TFLOPS from benchmark CSVs (columns of torch_sdpa_bench.py), one table per
mode (fwd, fwdbwd) present in a file.

    scripts/tables/perf-table.py docs/perf/h100.csv [docs/perf/h100-burn-peers.csv]

Each CSV is one GPU call: ratios are only formed between rows of the same file.
"""
import csv
import sys
from collections import defaultdict

# `--atomic-dq` rows (`with_deterministic(false)`), compared with FlashAttention-2 where present.
ATOMIC = "burn-flash-atomicdq"


def load(path, mode):
    rows = defaultdict(dict)
    with open(path) as f:
        for r in csv.DictReader(line for line in f if not line.startswith("#")):
            if r["mode"] != mode:
                continue
            key = (int(r["d"]), r["causal"] == "True", int(r["n"]))
            rows[key][r["impl"]] = float(r["tflops"])
    return rows


def modes(path):
    with open(path) as f:
        found = [r["mode"] for r in csv.DictReader(line for line in f if not line.startswith("#"))]
    return sorted(set(found), key=found.index)


def table(path, mode, peers):
    rows = load(path, mode)
    impls = sorted({i for v in rows.values() for i in v}, key=lambda i: (i != "burn-flash", i))
    head = ["d", "causal", "n"] + impls + [f"flash / {p}" for p in peers if p in impls]
    if ATOMIC in impls:
        head.append("atomic dQ / torch-flash")
    name = {"fwd": "forward", "fwdbwd": "forward+backward"}.get(mode, mode)
    print(f"From `{path}` (TFLOPS, {name}):\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for (d, causal, n), v in sorted(rows.items()):
        cells = [str(d), "yes" if causal else "no", str(n)]
        cells += [f"{v[i]:.1f}" if i in v else "–" for i in impls]
        for p in peers:
            if p in impls:
                ok = "burn-flash" in v and p in v and v[p] > 0
                cells.append(f"{v['burn-flash'] / v[p]:.2f}×" if ok else "–")
        if ATOMIC in impls:
            ok = ATOMIC in v and "torch-flash" in v
            cells.append(f"{v[ATOMIC] / v['torch-flash']:.2f}×" if ok else "–")
        print("| " + " | ".join(cells) + " |")
    print()


if __name__ == "__main__":
    for path in sys.argv[1:]:
        for mode in modes(path):
            table(path, mode, ["torch-flash", "torch-cudnn", "burn-unfused", "burn-builtin"])
