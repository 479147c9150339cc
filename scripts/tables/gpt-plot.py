#!/usr/bin/env python3
"""Loss curves of examples/gpt as an SVG, with no plotting library.

    scripts/tables/gpt-plot.py OUT.svg LABEL=CURVE.csv [LABEL=CURVE.csv ...]

Each CSV is the example's `--csv` output (step,lr,train_loss,val_loss). Training loss is drawn
thin, validation loss (the steps that evaluate) thick with dots, one colour and dash per run.
"""
import csv
import math
import sys

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
# Runs that agree lie on top of each other: dashes keep each one visible.
DASHES = ["", "9 5", "2 4", "12 3 2 3", "6 6"]
W, H, LEFT, RIGHT, TOP, BOTTOM = 760, 440, 64, 180, 36, 48


def read(path):
    train, val = [], []
    with open(path) as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            train.append((step, float(row["train_loss"])))
            if row["val_loss"]:
                val.append((step, float(row["val_loss"])))
    return train, val


def ticks(lo, hi, count=6):
    raw = (hi - lo) / count
    unit = 10 ** math.floor(math.log10(raw))
    step = next(m * unit for m in (1, 2, 2.5, 5, 10) if m * unit >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def main():
    out, runs = sys.argv[1], [arg.split("=", 1) for arg in sys.argv[2:]]
    data = [(label, *read(path)) for label, path in runs]
    steps = [s for _, train, _ in data for s, _ in train]
    losses = [v for _, train, val in data for _, v in train + val]
    x0, x1 = 0, max(steps)
    y0, y1 = math.floor(min(losses) * 2) / 2, math.ceil(max(losses) * 2) / 2
    px = lambda x: LEFT + (x - x0) / (x1 - x0) * (W - LEFT - RIGHT)
    py = lambda y: H - BOTTOM - (y - y0) / (y1 - y0) * (H - TOP - BOTTOM)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>']
    for x in ticks(x0, x1):
        svg.append(f'<line x1="{px(x):.1f}" y1="{TOP}" x2="{px(x):.1f}" y2="{H - BOTTOM}" stroke="#ddd"/>')
        svg.append(f'<text x="{px(x):.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{x:g}</text>')
    for y in ticks(y0, y1):
        svg.append(f'<line x1="{LEFT}" y1="{py(y):.1f}" x2="{W - RIGHT}" y2="{py(y):.1f}" stroke="#ddd"/>')
        svg.append(f'<text x="{LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    svg.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 10}" text-anchor="middle">step</text>')
    svg.append(f'<text x="16" y="{(TOP + H - BOTTOM) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {(TOP + H - BOTTOM) / 2})">loss (nats per byte)</text>')
    for i, (label, train, val) in enumerate(data):
        c, dash = COLOURS[i % len(COLOURS)], DASHES[i % len(DASHES)]
        line = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in train)
        svg.append(f'<polyline points="{line}" fill="none" stroke="{c}" stroke-width="1" opacity="0.45"/>')
        line = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in val)
        svg.append(f'<polyline points="{line}" fill="none" stroke="{c}" stroke-width="2.2" '
                   f'stroke-dasharray="{dash}"/>')
        svg += [f'<circle cx="{px(s):.1f}" cy="{py(v):.1f}" r="2.6" fill="{c}"/>' for s, v in val]
        y = TOP + 10 + 34 * i
        svg.append(f'<line x1="{W - RIGHT + 14}" y1="{y}" x2="{W - RIGHT + 38}" y2="{y}" stroke="{c}" '
                   f'stroke-width="2.2" stroke-dasharray="{dash}"/>')
        svg.append(f'<text x="{W - RIGHT + 44}" y="{y + 4}">{label}</text>')
        svg.append(f'<text x="{W - RIGHT + 44}" y="{y + 18}" fill="#666">val {val[-1][1]:.4f}</text>')
    svg.append(f'<text x="{LEFT}" y="{TOP - 14}">thin: training loss per step; thick: validation loss</text>')
    svg.append("</svg>")
    with open(out, "w") as f:
        f.write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
