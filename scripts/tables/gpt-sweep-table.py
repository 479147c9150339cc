#!/usr/bin/env python3
"""The context sweep of `scripts/gpu-run.sh gpt-sweep` as CSV and a markdown table.

    scripts/tables/gpt-sweep-table.py OUT.csv LOG_DIR [LOG_DIR ...]

Reads every gpt-sweep-<attention>-<context>.log: its summary line, or the reason it stopped
(out of device memory, the time limit, another error).
"""
import csv
import pathlib
import re
import sys

SUMMARY = re.compile(
    r"summary: \S+ x(\d+) \S+ attention (\w+) \| (\d+) steps x (\d+) tokens in [\d.]+ s \| "
    r"(\d+) tokens/s .*\| peak reserved ([\d.]+) MiB per device \| "
    r"train loss [\d.]+ -> ([\d.]+)"
)
NAMES = {"Flash": "flash", "BurnBuiltin": "burn", "Unfused": "unfused"}


def row(path):
    attention, context = re.match(r"gpt-sweep-(\w+)-(\d+)\.log", path.name).groups()
    text = path.read_text(errors="replace")
    found = SUMMARY.search(text)
    if found:
        _, name, _, tokens, speed, peak, loss = found.groups()
        return dict(attention=NAMES[name], context=int(context),
                    batch=int(tokens) // int(context), tokens_per_step=int(tokens),
                    tokens_per_s=int(speed), peak_reserved_mib=float(peak),
                    final_train_loss=float(loss), status="ok")
    allocation = re.search(r"can't allocate buffer of size: (\d+)", text)
    status = (f"out of memory ({int(allocation.group(1)) / 2**30:.1f} GiB buffer)"
              if allocation else "no summary (time limit or error)")
    return dict(attention=attention, context=int(context), batch="", tokens_per_step="",
                tokens_per_s="", peak_reserved_mib="", final_train_loss="", status=status)


def main():
    out, dirs = sys.argv[1], sys.argv[2:]
    logs = sorted(p for d in dirs for p in pathlib.Path(d).glob("gpt-sweep-*.log"))
    rows = sorted((row(p) for p in logs), key=lambda r: (r["attention"], r["context"]))
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print("| context × batch | attention | tokens/s | peak reserved | train loss (step 25) |")
    print("|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["context"], r["attention"])):
        if r["status"] == "ok":
            print(f"| {r['context']} × {r['batch']} | {r['attention']} | {r['tokens_per_s']:,} | "
                  f"{r['peak_reserved_mib'] / 1024:.1f} GiB | {r['final_train_loss']:.4f} |")
        else:
            print(f"| {r['context']} | {r['attention']} | {r['status']} | | |")


if __name__ == "__main__":
    main()
