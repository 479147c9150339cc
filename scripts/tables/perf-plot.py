#!/usr/bin/env python3
"""TFLOPS against sequence length from a benchmark CSV, one panel per configuration, as an SVG
with no plotting library.

    scripts/tables/perf-plot.py docs/perf/h100.csv docs/perf/h100.svg

Panels: forward and forward+backward (rows) by head dim and causality (columns); a line per
implementation (burn-flash, its `--atomic-dq` rows, PyTorch's FlashAttention-2 and cuDNN
backends). Rows with other head counts (GQA) or implementations measured at a few shapes only
are left out.
"""
import csv
import math
import sys
from collections import defaultdict

IMPLS = {"burn-flash": ("#d62728", ""), "burn-flash-atomicdq": ("#ff7f0e", "4 2"),
         "torch-flash": ("#1f77b4", "7 4"), "torch-cudnn": ("#2ca02c", "2 3")}
PW, PH, ML, MT, MB, GAP = 250, 190, 48, 40, 40, 26


def main():
    src, out = sys.argv[1], sys.argv[2]
    series = defaultdict(list)
    for r in csv.DictReader(l for l in open(src) if not l.startswith("#")):
        if r["impl"] in IMPLS and r["h"] == r["hkv"]:
            key = (r["mode"], int(r["d"]), r["causal"] == "True")
            series[key, r["impl"]].append((int(r["n"]), float(r["tflops"])))
    modes = [m for m in ("fwd", "fwdbwd") if any(k[0][0] == m for k in series)]
    cols = sorted({(k[0][1], k[0][2]) for k in series})
    width = ML + len(cols) * (PW + GAP) + 150
    height = MT + len(modes) * (PH + MB + GAP)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    top = max(v for pts in series.values() for _, v in pts)
    ymax = math.ceil(top / 100) * 100
    for i, mode in enumerate(modes):
        for j, (d, causal) in enumerate(cols):
            x0, y0 = ML + j * (PW + GAP), MT + i * (PH + MB + GAP)
            ns = sorted({n for (k, _), pts in series.items() if k == (mode, d, causal)
                         for n, _ in pts})
            if not ns:
                continue
            lx = lambda n: x0 + (math.log2(n) - math.log2(ns[0])) / max(
                1e-9, math.log2(ns[-1]) - math.log2(ns[0])) * PW
            ly = lambda v: y0 + PH - v / ymax * PH
            title = f'{"forward" if mode == "fwd" else "forward+backward"}, d {d}, ' \
                    f'{"causal" if causal else "not causal"}'
            svg.append(f'<text x="{x0 + PW / 2}" y="{y0 - 8}" text-anchor="middle" '
                       f'font-weight="bold">{title}</text>')
            svg.append(f'<rect x="{x0}" y="{y0}" width="{PW}" height="{PH}" fill="none" stroke="#999"/>')
            for v in range(0, ymax + 1, 100):
                svg.append(f'<line x1="{x0}" y1="{ly(v):.1f}" x2="{x0 + PW}" y2="{ly(v):.1f}" stroke="#e5e5e5"/>')
                if j == 0:
                    svg.append(f'<text x="{x0 - 4}" y="{ly(v) + 4:.1f}" text-anchor="end">{v}</text>')
            for n in ns:
                label = f"{n // 1024}k" if n >= 1024 else str(n)
                svg.append(f'<text x="{lx(n):.1f}" y="{y0 + PH + 14}" text-anchor="middle">{label}</text>')
            for impl, (colour, dash) in IMPLS.items():
                pts = sorted(series.get(((mode, d, causal), impl), []))
                if not pts:
                    continue
                line = " ".join(f"{lx(n):.1f},{ly(v):.1f}" for n, v in pts)
                svg.append(f'<polyline points="{line}" fill="none" stroke="{colour}" '
                           f'stroke-width="2" stroke-dasharray="{dash}"/>')
                svg += [f'<circle cx="{lx(n):.1f}" cy="{ly(v):.1f}" r="2.5" fill="{colour}"/>'
                        for n, v in pts]
        svg.append(f'<text x="12" y="{MT + i * (PH + MB + GAP) + PH / 2}" text-anchor="middle" '
                   f'transform="rotate(-90 12 {MT + i * (PH + MB + GAP) + PH / 2})">TFLOPS</text>')
    lx0 = ML + len(cols) * (PW + GAP)
    for k, (impl, (colour, dash)) in enumerate(IMPLS.items()):
        y = MT + 10 + 22 * k
        svg.append(f'<line x1="{lx0}" y1="{y}" x2="{lx0 + 26}" y2="{y}" stroke="{colour}" '
                   f'stroke-width="2" stroke-dasharray="{dash}"/>')
        svg.append(f'<text x="{lx0 + 32}" y="{y + 4}">{impl}</text>')
    svg.append(f'<text x="{lx0}" y="{MT + 90}" fill="#666">x: sequence length</text>')
    svg.append("</svg>")
    open(out, "w").write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
