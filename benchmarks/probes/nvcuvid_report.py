"""Markdown tables from nvcuvid_scaling.py results (one JSON holding several runs):

python benchmarks/probes/nvcuvid_report.py benchmarks/results/decode-h200-nvcuvid.json
"""

from __future__ import annotations

import json
import pathlib
import sys


def _f(v, nd=2) -> str:
    return "" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def decode_table(records: list[dict]) -> list[str]:
    rows = ["| case | backend | threads | frames/s | coded Gbit/s | fp16-eq GB/s |", "|---|---|---|---|---|---|"]
    for r in records:
        if r.get("kind") == "decode-only":
            rows.append(
                f"| {r['case']} | {r['backend']} | {r['threads']} | {_f(r['frames_per_s'], 0)} | "
                f"{_f(r['coded_gbit_per_s'])} | {_f(r['restored_gb_per_s'])} |"
            )
    for r in records:
        if r.get("kind") == "decode-only-interference":
            rows.append(
                f"| {r['case']} | {r['backend']} (matmul beside it: {100 * r['matmul_slowdown']:.1f}% slower) | "
                f"{r['threads']} | | | |"
            )
    return rows


def restore_table(records: list[dict]) -> list[str]:
    rows = [
        "| case | backend | threads / workers | CUDA contexts | restored GB/s (fp16-eq) | coded Gbit/s | "
        "matmul slowdown | restored GB/s under matmul | standing MB | exact vs CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r.get("kind") != "restore":
            continue
        if "error" in r:
            rows.append(f"| {r['case']} | {r['backend']} | | | failed: {r['error'][:80]} | | | | | |")
            continue
        exact = "yes" if r.get("exact_vs_cpu") and all(r["exact_vs_cpu"].values()) else "NO"
        rows.append(
            f"| {r['case']} | {r['backend']} | {r['threads']} | {r['cuda_contexts']} | {_f(r['restored_gb_per_s'])} | "
            f"{_f(r['coded_gbit_per_s'])} | {100 * r['matmul_slowdown']:.1f}% | "
            f"{_f(r.get('restored_gb_per_s_under_matmul'))} | {_f(r['standing_mb'], 0)} | {exact} |"
        )
    return rows


def render(result: dict) -> str:
    out = []
    for run in result["runs"]:
        out += [
            f"### {run['title']}",
            "",
            f"`{run['command']}`",
            "",
            f"Code: {run['code']}. "
            f"Matmul alone: {run['matmul_alone_tflops']} TFLOP/s (again at the end: "
            f"{run.get('matmul_alone_again_tflops')}).",
            "",
        ]
        out += decode_table(run["records"]) + [""] + restore_table(run["records"]) + [""]
    return "\n".join(out)


if __name__ == "__main__":
    print(render(json.loads(pathlib.Path(sys.argv[1]).read_text())))
