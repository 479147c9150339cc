#!/usr/bin/env python3
"""Markdown table of each feature's forward TFLOPS against plain attention, from the CSV of
`scripts/gpu-run.sh features` (rows of one call): one row per feature and head dim, one column
per (n, causal), each cell `TFLOPS (change vs plain)`. Plain attention is measured first and
last in the call; the table compares with the mean of the two and shows both.

    scripts/tables/feature-table.py FEATURES.csv [MODE]   (MODE: fwd, the default, or fwdbwd)
"""
import csv
import sys

rows = list(csv.DictReader(open(sys.argv[1])))
mode = sys.argv[2] if len(sys.argv) > 2 else "fwd"
rows = [r for r in rows if r["mode"] == mode]
key = lambda r: (r["d"], r["n"], r["causal"])
plain_runs = {}
for r in rows:
    if r["impl"] == "burn-flash" and r["h"] == r["hkv"]:
        plain_runs.setdefault(key(r), []).append(float(r["tflops"]))
plain = {k: sum(v) / len(v) for k, v in plain_runs.items()}
cols = sorted({(r["n"], r["causal"]) for r in rows if key(r) in plain}, key=lambda c: (int(c[0]), c[1]))
names = {"burn-flash": "plain", "burn-flash-keypad": "key padding `[b, n]`",
         "burn-flash-mask": "mask `[b, 1, n, n]`", "burn-flash-bias": "bias `[1, h, n, n]`",
         "burn-flash-alibi": "ALiBi", "burn-flash-drop0.1": "dropout 0.1",
         "burn-flash-cap30": "softcap 30"}
print("| feature | d | " + " | ".join(f"n {n}{' causal' if c == 'True' else ''}" for n, c in cols) + " |")
print("|---|---|" + "---|" * len(cols))
for impl, name in names.items():
    for d in sorted({r["d"] for r in rows}, key=int):
        cells = []
        for n, c in cols:
            got = [float(r["tflops"]) for r in rows
                   if r["impl"] == impl and key(r) == (d, n, c) and r["h"] == r["hkv"]]
            if not got or (d, n, c) not in plain:
                cells.append("—")
                continue
            base = plain[(d, n, c)]
            if impl == "burn-flash":
                runs = plain_runs[(d, n, c)]
                cells.append(f"{base:.1f} ({' / '.join(f'{v:.1f}' for v in runs)})")
            else:
                cells.append(f"{got[0]:.1f} ({(got[0] / base - 1) * 100:+.1f} %)")
        if any(cell != "—" for cell in cells):
            print(f"| {name} | {d} | " + " | ".join(cells) + " |")
