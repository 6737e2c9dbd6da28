#!/usr/bin/env python3
"""Probe (issue 21): how far prefixes' levels spread at one target ratio, and what moving a level
along rate.on_grid's grid does to its size. For each KV file and prefix length: the level the
size search finds (the grid off) and its grid level; for the first --sizes files, the ratio vs fp16
at the searched level and 1/16 octave (half a grid step) either side.

    python benchmarks/probes/level_grid.py KVT OUT.json KV_FILE... [--ratios 5,8] [--tokens 512,1024,2048] [--sizes 2]

KVT: a calibration of the files' model; KV_FILE: `kvcodec extract` files."""

from __future__ import annotations

import argparse
import json
import math

from kvbench.ttft import load_kv
from kvcodec.codecs.transform.codec import TransformCodec
from kvcodec.transform import rate

HALF_STEP = 0.5 / rate.LEVELS_PER_OCTAVE  # octaves


def _ratio(kvt: str, kv, theta: float) -> float:  # noqa: ANN001
    codec = TransformCodec(kvt, theta=theta)
    return kv.numel() * 2 / sum(len(b) for chunk in codec.encode_chunks(kv) for b in chunk.blobs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kvt")
    ap.add_argument("out")
    ap.add_argument("kv_files", nargs="+")
    ap.add_argument("--ratios", default="5,8")
    ap.add_argument("--tokens", default="512,1024,2048")
    ap.add_argument("--sizes", type=int, default=2, help="files whose size is measured either side (1024 tokens)")
    a = ap.parse_args()
    searched = rate.on_grid
    rate.on_grid = lambda theta: theta  # the codec's level as its search finds it
    records = []
    for ratio in (float(r) for r in a.ratios.split(",")):
        codec = TransformCodec(a.kvt, target_ratio=ratio)
        for i, path in enumerate(a.kv_files):
            kv = load_kv(path)[0]
            for tokens in (int(t) for t in a.tokens.split(",") if int(t) <= kv.shape[2]):
                prefix = kv[:, :, :tokens].contiguous()
                theta = codec._level(None, prefix, 0)
                rec = {"ratio": ratio, "kv_file": path.rsplit("/", 1)[-1], "tokens": tokens, "level": theta}
                rec |= {"log2_level": math.log2(theta), "grid_level": searched(theta)}
                if i < a.sizes and tokens == 1024:
                    rec["ratio_at"] = {
                        f"{o:+.4f}": _ratio(a.kvt, prefix, theta * 2**o) for o in (-HALF_STEP, 0.0, HALF_STEP)
                    }
                print(json.dumps(rec), flush=True)
                records.append(rec)
    with open(a.out, "w") as f:
        json.dump(
            {"command": "python benchmarks/probes/level_grid.py KVT OUT.json KV_FILE...", "records": records},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
