#!/usr/bin/env python3
"""SVG chart of rate vs accuracy from benchmarks/results/rd-*.json:

python benchmarks/rd_plot.py benchmarks/results/rd-*.json --out benchmarks/results/rd-curves.svg
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import click


def family(method: str) -> str:
    for coder in ("hevc", "zstd"):
        if method.startswith(f"transform-{coder}-r") and method.count("-") == 2:
            return f"transform ({coder.upper() if coder == 'hevc' else coder})"
    return method


PANELS = (  # (record key, y label, target line)
    ("top1_agreement", "top-1 agreement vs recomputed", 0.99),
    ("ppl_delta_pct", "perplexity change (%)", 0.5),
    ("same_answer_rate", "Quoref same answer as recomputed", 0.95),
)


@click.command()
@click.argument("files", nargs=-1, required=True)
@click.option("--out", required=True)
def main(files, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = defaultdict(list)  # (model, family) -> [(ratio, {key: value})]
    for f in files:
        for r in json.loads(Path(f).read_text())["records"]:
            if r["method"] != "fp16":
                points[(r["model"], family(r["method"]))].append((r["ratio_vs_fp16"], r))
    models = sorted({m for m, _ in points})
    panels = [p for p in PANELS if any(p[0] in r for pts in points.values() for _, r in pts)]
    fig, axes = plt.subplots(len(panels), len(models), figsize=(6 * len(models), 4 * len(panels)), squeeze=False)
    for col, model in enumerate(models):
        for (m, fam), pts in sorted(points.items()):
            if m != model:
                continue
            pts.sort(key=lambda p: p[0])
            style = "-o" if fam.startswith("transform (") else "s"
            for row, (key, _, _) in enumerate(panels):
                xy = [(x, r[key]) for x, r in pts if key in r]
                if xy:
                    axes[row][col].plot([a for a, _ in xy], [b for _, b in xy], style, label=fam)
        axes[0][col].set_title(model)
        for row, (_, label, target) in enumerate(panels):
            axes[row][col].set_ylabel(label)
            axes[row][col].axhline(target, color="grey", lw=0.5)
            axes[row][col].axvline(5, color="grey", lw=0.5, ls=":")
        axes[-1][col].set_xlabel("ratio vs fp16")
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, format="svg")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
