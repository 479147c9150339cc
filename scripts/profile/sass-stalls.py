#!/usr/bin/env python3
"""Warp samples per stall reason, and the opcodes that carry most of each.

    python3 scripts/profile/sass-stalls.py FILE.sass.csv...

FILE comes from `ncu -i REP --page source --print-source sass --csv` of a `--set full` profile,
whose per-instruction `stall_*` columns count the warp-state samples taken at that instruction.
Per file and reason: the total, then the seven opcodes with the most samples. A reason that
grows on one opcode between two kernels tells which unit their warps wait for (`mio` on `LDSM`:
the shared-memory instruction queue is full; `math` on `HMMA`: the tensor pipe is busy).
"""
import collections
import csv
import sys

REASONS = ["math", "mio", "long_sb", "short_sb", "wait", "not_selected", "barrier", "lg"]


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


for path in sys.argv[1:]:
    rows = list(csv.reader(open(path)))
    header, data = rows[1], rows[2:]
    index = {name: i for i, name in enumerate(header)}
    print("==", path)
    for reason in REASONS:
        by_op = collections.Counter()
        for row in data:
            words = row[index["Source"]].split()
            op = words[1] if words[0].startswith("@") else words[0]
            by_op[op.split(".")[0]] += number(row[index["stall_" + reason]])
        top = " ".join(f"{op}:{n:.0f}" for op, n in by_op.most_common(7))
        print(f"stall_{reason:14s} {sum(by_op.values()):8.0f} {top}")
