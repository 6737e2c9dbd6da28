#!/usr/bin/env python3
"""Probe (issue 21): the fetch's host set-up before its first blob is asked for, step by step: the chunk
keys, the chunks' metas (one batched get, each meta parsed and checked), the decode profile and the
pipeline's construction. Interpreter work on the fetch's critical path, the same on any device: it runs
on the CPU. For A/B runs of two trees, run it under each tree's PYTHONPATH in turn.

    python benchmarks/probes/fetch_setup.py --kv KV.safetensors --transform MODEL.kvt --out OUT.json

KV: a plain KV file (`kvcodec extract`); its tokens are coded at --ratio into a memory:// store, then
--fetches fetches time each step (median, us)."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

STEPS = ("keys", "_checked_meta", "_plan", "_profile_for", "_result")


def _timed(owner, name: str, times: dict) -> None:  # noqa: ANN001
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*a, **k):  # noqa: ANN202
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            times.setdefault(name, []).append(time.perf_counter() - t)

    setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", required=True)
    ap.add_argument("--transform", required=True)
    ap.add_argument("--ratio", type=float, default=5.0)
    ap.add_argument("--fetches", type=int, default=200)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import kvcodec
    from kvcodec.fetcher import PrefixCache
    from kvcodec.fetcher import pipeline as pl
    from kvcodec.kvspec.files import load_plain_kv
    from kvcodec.store import open_store

    kv = load_plain_kv(a.kv)[0].half()
    codec = kvcodec.make_codec("transform", transform=a.transform, target_ratio=a.ratio)
    ids = list(range(1000, 1000 + kv.shape[2]))
    cache = PrefixCache(open_store("memory://"), "probe", codec)
    cache.put(ids, kv)
    times: dict[str, list[float]] = {}
    for name in STEPS:
        _timed(PrefixCache, name, times)
    _timed(pl.FetchPipeline, "__init__", times)
    for _ in range(3):
        cache.fetch(ids)
    times.clear()
    for _ in range(a.fetches):
        cache.fetch(ids)
    per_fetch = {k: round(sum(v) / a.fetches * 1e6, 1) for k, v in times.items()}
    median = {k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()}
    doc = {"tokens": len(ids), "chunks": len(cache.keys(ids)), "us_per_fetch": per_fetch, "median_us_per_call": median}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
