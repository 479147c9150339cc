#!/usr/bin/env python3
"""Instruction mix and stall reasons per kernel from Nsight Compute's source page
(`ncu -i REPORT --page source --print-source sass --csv`, as `scripts/gpu-run.sh profile`
writes it): executed warp instructions per opcode, in millions, and the share of each stall
reason in the warp samples.

    python3 scripts/profile/sass-mix.py FILE.sass.csv...
"""
import collections
import csv
import sys


def kernels(path):
    out, name, header = {}, None, None
    for row in csv.reader(open(path)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            name, header = row[1], None
            out[name] = []
        elif header is None:
            header = row
        else:
            out[name].append(dict(zip(header, row)))
    return out


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


for path in sys.argv[1:]:
    for name, rows in kernels(path).items():
        mix, stalls = collections.Counter(), collections.Counter()
        columns = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
        for row in rows:
            words = row["Source"].split()
            op = (words[1] if words and words[0].startswith("@") else (words or ["?"])[0])
            mix[op.split(".")[0]] += number(row["Instructions Executed"])
            for c in columns:
                stalls[c] += number(row[c])
        total, sampled = sum(mix.values()), sum(stalls.values()) or 1
        print(f"{path}: {name[:70]}: {total / 1e6:.1f}M instructions, {len(rows)} static")
        print("  " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in mix.most_common(20)))
        print("  stalls: " + ", ".join(
            f"{k[6:]} {100 * v / sampled:.0f}%" for k, v in stalls.most_common(8)))
