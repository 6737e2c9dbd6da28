#!/usr/bin/env python3
"""Probe (issue 21): what a transform-coded prefix's own level costs its fetch. A prefix stored
to a target ratio is coded at a level (theta) measured on its own KV, so a server's prefixes each
bring a level its restorer has not seen; the restorer builds that level's batched plan (the
decode bases) during the fetch. Timed here on one device: the plan alone, for levels near the
stored one, and a PrefixCache fetch with the restorer's plans dropped before it (a level not
seen) against one that finds its plan (the benchmarks' repeated fetches).

    python benchmarks/probes/plan_cost.py KVT KV_FILE OUT.json [--tokens 8192] [--ratio 5] [--repeat 7]

KVT: a .kvt of the target's shape (ttft-engine prep writes one); KV_FILE: a `kvcodec extract` file
whose values are tiled into that shape."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvbench import ttft_engine
from kvcodec.codecs.transform.codec import TransformCodec
from kvcodec.fetcher import PrefixCache
from kvcodec.store import open_store


def _synced(fn) -> float:  # noqa: ANN001
    torch.cuda.synchronize()
    begin = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - begin


def _forget_plans(codec: TransformCodec) -> None:
    codec._restorer._batched_plans.clear()
    codec._restorer._coord_plans.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kvt")
    ap.add_argument("kv_file")
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--ratio", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    codec = TransformCodec(a.kvt, target_ratio=a.ratio)
    shape = (codec.cal.layers, codec.cal.kv_heads, codec.cal.head_dim)
    kv = ttft_engine.seed_kv(ttft_engine.real_kv(a.kv_file), shape, a.tokens).cuda()
    ids = list(range(10_000, 10_000 + a.tokens))
    store = open_store("memory://")
    cache = PrefixCache(store, "plan-cost", codec, "cuda")
    cache.put(ids, kv)
    cache.warm_up(torch.float16)
    out = torch.empty_like(kv)

    def fetch() -> None:
        assert cache.fetch(ids, out=out).tokens_restored == a.tokens

    for _ in range(3):
        fetch()
    theta = list(codec._restorer._batched_plans)[-1][0]  # the stored level's plan: the last one used
    warm = [_synced(fetch) for _ in range(a.repeat)]
    cold = []
    for _ in range(a.repeat):
        _forget_plans(codec)
        cold.append(_synced(fetch))
    plans = []
    for k in range(a.repeat):
        level = {"theta": theta * (1 + 0.01 * (k + 1)), "key_weight": codec.key_weight}
        plans.append(_synced(lambda level=level: codec._restorer._batched_plan(level, torch.device("cuda"))))
    rec = {
        "command": "python benchmarks/probes/plan_cost.py KVT KV_FILE OUT.json "
        f"--tokens {a.tokens} --ratio {a.ratio} --repeat {a.repeat}",
        "device": torch.cuda.get_device_name(),
        "shape": shape,
        "tokens": a.tokens,
        "theta": theta,
        "fetch_s_plan_found": statistics.median(warm),
        "fetch_s_plan_built": statistics.median(cold),
        "plan_build_s": statistics.median(plans),
        "runs": {"plan_found": warm, "plan_built": cold, "plan_build": plans},
    }
    print(json.dumps({k: v for k, v in rec.items() if k != "runs"}))
    with open(a.out, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
