#!/usr/bin/env python3
"""Probe (issue 21, the SM alternative): how many bytes the transform codec's integers take when
entropy-coded for decoding on the SMs (an ANS/rANS coder, as nvCOMP's ANS) instead of as HEVC
video for NVDEC, on prepared fetch_restore.py stores (real models' KV).

Per chunk the HEVC stream is decoded on the CPU (FFmpeg) back to its samples (the integers the
inverse transform reads), and coded again: order-0 entropy with one table per chunk and one table
per 64 KiB block (what a byte-wise ANS coder such as nvCOMP's reaches, tables not counted), and
zstd-19 (a real coder, for scale). Side streams (header, escapes, sink tokens) are counted as
stored. Ratios are against fp16.

    python benchmarks/probes/sm_entropy.py --dir .fr/qwen8k --dir .fr/smol --out benchmarks/results/sm-entropy-cpu
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys

import numpy as np
import zstandard

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
BLOCK = 64 << 10


def entropy_bytes(x: np.ndarray) -> float:
    counts = np.bincount(x, minlength=256).astype(np.float64)
    p = counts[counts > 0] / x.size
    return float(-(p * np.log2(p)).sum() * x.size / 8)


def case_record(d: pathlib.Path, doc: dict, case: dict) -> dict:
    import fetch_restore as fr
    import torch

    from kvcodec.fetcher import blob_key
    from kvcodec.store import open_store

    codec = fr.make_codec(case, d)
    store = open_store(f"file://{d / 'store'}")
    sums = dict.fromkeys(("blob", "video", "samples", "ent_chunk", "ent_block", "zstd19"), 0.0)
    for k in fr._keys(doc, case):
        blob = store.get(blob_key(k, 0))
        h, streams = codec._read(blob)
        staged = codec._restorer.decode_samples(h, streams, torch.device("cpu"))
        x = staged.samples.contiguous().numpy().reshape(-1)
        sums["blob"] += len(blob)
        sums["video"] += len(streams["video"])
        sums["samples"] += x.size
        sums["ent_chunk"] += entropy_bytes(x)
        sums["ent_block"] += sum(entropy_bytes(x[o : o + BLOCK]) for o in range(0, x.size, BLOCK))
        sums["zstd19"] += len(zstandard.ZstdCompressor(level=19).compress(x.tobytes()))
    fp16, side = doc["fp16_bytes"], sums["blob"] - sums["video"]
    rec = {"model": doc["model"], "tokens": len(doc["ids"]), "name": case["name"], "chunks": len(fr._keys(doc, case))}
    rec["samples_per_fp16_byte"] = round(sums["samples"] / fp16, 4)
    for name in ("video", "ent_chunk", "ent_block", "zstd19"):
        rec[f"ratio_{name}"] = round(fp16 / (side + sums[name]), 3)
    rec["ans_bytes_over_hevc"] = round((side + sums["ent_block"]) / sums["blob"], 3)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=pathlib.Path, action="append", required=True)
    ap.add_argument("--only", default="t5,t8")
    ap.add_argument("--out", type=pathlib.Path, required=True)
    a = ap.parse_args()
    from kvbench.results import write_result

    recs = []
    for d in a.dir:
        doc = json.loads((d / "cases.json").read_text())
        for case in doc["cases"]:
            if case["name"] in a.only.split(",") and case["codec"] == "transform":
                recs.append(case_record(d, doc, case))
                print(json.dumps(recs[-1]), flush=True)
    cols = list(recs[0])
    md = ["# The transform's integers: HEVC (NVDEC) against entropy coding for the SMs", ""]
    md += ["Command: `python " + shlex.join(["benchmarks/probes/sm_entropy.py", *sys.argv[1:]]) + "`", ""]
    md += ["Ratios vs fp16 with the side streams as stored; `ent_block`: order-0 entropy per 64 KiB block", ""]
    md += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in recs]
    write_result(
        a.out,
        {"command": "python " + shlex.join(["benchmarks/probes/sm_entropy.py", *sys.argv[1:]]), "records": recs},
        md,
    )


if __name__ == "__main__":
    main()
