"""Which single frame resolution should CodecConfig default to? Encodes real KV caches at each
candidate resolution alone and records the stored bytes, the encode time and the CPU decode time.

    python benchmarks/probes/resolution_default.py KV.safetensors [...] --out results/NAME
(KV files from `kvcodec extract`; writes NAME.json and NAME.md)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

import kvcodec

CANDIDATES = ((256, 256), (512, 512), (1024, 1024))


def _load(path: str) -> tuple[torch.Tensor, dict]:
    with safe_open(path, "pt") as f:
        meta = f.metadata() or {}
        return f.get_tensor("kv"), {k: meta.get(k) for k in ("model", "text", "tokens")}


def measure(kv: torch.Tensor, quant: str, res: tuple[int, int]) -> dict:
    config = kvcodec.CodecConfig(quant=quant, resolutions=(res,))
    t0 = time.perf_counter()
    data = kvcodec.encode(kv, config)
    t1 = time.perf_counter()
    out = kvcodec.decode(data)
    t2 = time.perf_counter()
    assert out.shape == kv.shape
    return {
        "quant": quant,
        "resolution": f"{res[0]}x{res[1]}",
        "file_bytes": len(data),
        "ratio_vs_fp16": 2 * kv.numel() / len(data),
        "encode_s": t1 - t0,
        "decode_cpu_s": t2 - t1,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kv", nargs="+")
    ap.add_argument("--quants", default="int8,int4,exact")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for path in args.kv:
        kv, meta = _load(path)
        for quant in args.quants.split(","):
            for res in CANDIDATES:
                row = {**meta, "shape": list(kv.shape), **measure(kv, quant, res)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    record = {
        "command": "python benchmarks/probes/resolution_default.py " + " ".join(sys.argv[1:]),
        "machine": f"CPU development VM, 2 cores ({platform.machine()}), torch threads 1",
        "rows": rows,
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [
        "# Default frame resolution: one resolution at a time on real KV (CPU)",
        "",
        f"`{record['command']}`",
        "",
        "| model | tokens | quant | resolution | file bytes | ratio vs fp16 | encode s | CPU decode s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['shape'][2]} | {r['quant']} | {r['resolution']} | {r['file_bytes']:,} | "
            f"{r['ratio_vs_fp16']:.3f} | {r['encode_s']:.2f} | {r['decode_cpu_s']:.2f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
