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
    if method.startswith("transform-hevc-r") and method.count("-") == 2:
        return "transform (HEVC)"
    return method


@click.command()
@click.argument("files", nargs=-1, required=True)
@click.option("--out", required=True)
def main(files, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = defaultdict(list)  # (model, family) -> [(ratio, top1, ppl)]
    for f in files:
        for r in json.loads(Path(f).read_text())["records"]:
            if r["method"] != "fp16":
                points[(r["model"], family(r["method"]))].append(
                    (r["ratio_vs_fp16"], r["top1_agreement"], r["ppl_delta_pct"])
                )
    models = sorted({m for m, _ in points})
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        for (m, fam), pts in sorted(points.items()):
            if m != model:
                continue
            pts.sort()
            style = "-o" if fam.startswith("transform (") else "s"
            axes[0][col].plot([p[0] for p in pts], [p[1] for p in pts], style, label=fam)
            axes[1][col].plot([p[0] for p in pts], [p[2] for p in pts], style, label=fam)
        axes[0][col].set_title(model)
        axes[0][col].set_ylabel("top-1 agreement vs recomputed")
        axes[1][col].set_ylabel("perplexity change (%)")
        axes[1][col].set_xlabel("ratio vs fp16")
        axes[0][col].axhline(0.99, color="grey", lw=0.5)
        axes[1][col].axhline(0.5, color="grey", lw=0.5)
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, format="svg")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
