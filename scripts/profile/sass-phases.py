#!/usr/bin/env python3
"""Warp samples by stretch of a kernel's SASS, in program order.

    python3 scripts/profile/sass-phases.py FILE.sass.csv [WINDOW]

FILE comes from `ncu -i REP --page source --print-source sass --csv`. Each row covers WINDOW
(default 60) consecutive instructions: the share of all warp-state samples, the share of
executed instructions and the most frequent opcodes; rows under 0.4 % of the samples are left
out. Where a stretch takes more samples than instructions, its warps wait there.
"""
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


rows, header = [], None
for row in csv.reader(open(sys.argv[1])):
    if not row:
        continue
    if row[0] == "Kernel Name":
        header = None
        continue
    if header is None:
        header = row
        continue
    rows.append(dict(zip(header, row)))
window = int(sys.argv[2]) if len(sys.argv) > 2 else 60
samples = sum(number(r["Warp Stall Sampling (All Samples)"]) for r in rows)
executed = sum(number(r["Instructions Executed"]) for r in rows)
print("total samples", samples, "instr", executed)
for first in range(0, len(rows), window):
    part = rows[first:first + window]
    share = sum(number(r["Warp Stall Sampling (All Samples)"]) for r in part) / samples
    if share < 0.004:
        continue
    ran = sum(number(r["Instructions Executed"]) for r in part) / executed
    ops = {}
    for r in part:
        words = r["Source"].split()
        if not words:
            continue
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        op = op.split(".")[0]
        ops[op] = ops.get(op, 0) + 1
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:6]
    print(f"{first:5d} {100 * share:5.1f}% instr {100 * ran:5.1f}%  "
          + " ".join(f"{op}{count}" for op, count in top))
