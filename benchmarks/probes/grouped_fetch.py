#!/usr/bin/env python3
"""Probe (issue 21): `GroupedPrefixCache.fetch` of a grouped KV file (sliding-window or MLA models) with the
fetch's defaults (on CUDA the driven restore: each group's part by its codec's DrivenChunks, each group's chunks
finished in one call) against the
fetch staged on decode workers (the driven restore off) and the unstaged one (every chunk decoded whole on a
decode worker), on any device, any grouped KV file and .kvt; transform-coded at given ratios and int8 HEVC.

    kvcodec extract --model DIR --text pg/web20 --max-tokens 2048 KV.safetensors
    kvcodec calibrate --model DIR --texts pg/aord,pg/apple --out G.kvt
    python benchmarks/probes/grouped_fetch.py --kv KV.safetensors --transform G.kvt --out OUT.json

Per case and variant: the median fetch time over --repeats fetches (each synchronized), the fp16-equivalent
GB/s restored, and the largest difference of the other variants' KV from the unstaged one's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import shlex
import statistics
import sys
import time

import torch

from kvcodec.codecs import driven, make_codec
from kvcodec.fetcher.grouped import GroupedPrefixCache
from kvcodec.kvspec import GroupedKV
from kvcodec.kvspec.files import load_kv_file
from kvcodec.store import open_store

# (GroupedPrefixCache's batched_restore, the driven restore on): the defaults (on CUDA: driven, every group's
# codec's DrivenChunks; elsewhere unstaged), staged on decode workers (driven off), every chunk decoded whole
VARIANTS = {"default": (None, True), "workers": (None, False), "unstaged": (False, True)}


def fp16_bytes(kv: GroupedKV) -> int:
    return 2 * sum(t.numel() for t in kv.tensors)


def timed_fetches(cache: GroupedPrefixCache, ids: list[int], repeats: int) -> tuple[list[float], GroupedKV]:
    result = None
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = cache.fetch(ids)
        if cache.device.type == "cuda":
            torch.cuda.synchronize(cache.device)
        times.append(time.perf_counter() - t0)
        if not result.ok or result.tokens_restored != len(ids):
            raise SystemExit(f"fetch restored {result.tokens_restored} of {len(ids)} tokens: {result.error}")
    return times, result.kv


def codec_of(case: str, kvt: str, chunk_tokens: int | None):  # noqa: ANN201 - a ChunkCodec
    """`transform:R` (the .kvt at target ratio R) or `hevc` (the int8 HEVC codec)."""
    options = {"chunk_tokens": chunk_tokens} if chunk_tokens else {}
    if case == "hevc":
        return make_codec("hevc", **options)
    kind, _, ratio = case.partition(":")
    if kind != "transform" or not ratio:
        raise SystemExit(f"a case is transform:RATIO or hevc; got {case!r}")
    return make_codec("transform", transform=kvt, target_ratio=float(ratio), **options)


@contextlib.contextmanager
def driven_on(on: bool):
    saved = driven.DRIVEN
    driven.DRIVEN = on
    try:
        yield
    finally:
        driven.DRIVEN = saved


def measure(kv: GroupedKV, case: str, codec, device: str, repeats: int, profile: bool = False) -> dict:  # noqa: ANN001
    store, ids = open_store("memory://"), list(range(1000, 1000 + kv.stop))
    GroupedPrefixCache(store, "probe", codec, "cpu", spec=kv.spec).put(ids, kv)
    gb = fp16_bytes(kv) / 1e9
    record, restored = {"case": case, "fp16_gb": gb, "stored_bytes": store.used_bytes()}, {}
    for name, (batched, on) in VARIANTS.items():
        cache = GroupedPrefixCache(store, "probe", codec, device, spec=kv.spec, batched_restore=batched)
        with driven_on(on):
            timed_fetches(cache, ids, 3)  # warm-up: sessions, plans, kernels
            times, restored[name] = timed_fetches(cache, ids, repeats)
        med = statistics.median(times)
        record[name] = {"median_ms": med * 1e3, "min_ms": min(times) * 1e3, "restored_gb_per_s": gb / med}
        print(f"{case} {name}: {med * 1e3:.2f} ms, {gb / med:.2f} GB/s", flush=True)
    unstaged = restored.pop("unstaged")
    record["max_abs_vs_unstaged"] = {
        name: max((a.float() - b.float()).abs().max().item() for a, b in zip(r.tensors, unstaged.tensors))
        for name, r in restored.items()
    }
    record["speedup_vs_unstaged"] = record["unstaged"]["median_ms"] / record["default"]["median_ms"]
    record["speedup_vs_workers"] = record["workers"]["median_ms"] / record["default"]["median_ms"]
    if profile:
        cache = GroupedPrefixCache(store, "probe", codec, device, spec=kv.spec)
        record["profile"] = sampled(cache, ids, repeats)
        record["calls"] = profiled(cache, ids, repeats)
    return record


def profiled(cache: GroupedPrefixCache, ids: list[int], repeats: int, top: int = 40) -> list:
    """cProfile over `repeats` default fetches (of the calling thread, where a driven fetch runs its restore; from
    Python 3.12 of every thread: cProfile runs on sys.monitoring):
    [function, calls per fetch, own ms per fetch, cumulative ms per fetch] of the `top` by own time. The
    sampler misplaces time spent holding the interpreter lock; this does not."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    timed_fetches(cache, ids, repeats)
    prof.disable()
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        [f"{pathlib.Path(f).name}:{line}:{name}", nc / repeats, 1e3 * tt / repeats, 1e3 * ct / repeats]
        for (f, line, name), (_, nc, tt, ct, _) in rows
    ]


def sampled(cache: GroupedPrefixCache, ids: list[int], repeats: int) -> dict:
    """Where each thread of `repeats` default fetches spends its time (fetch_restore.Sampler), ms per fetch."""
    from fetch_restore import Sampler

    with Sampler() as sampler:
        t0 = time.perf_counter()
        timed_fetches(cache, ids, repeats)
        wall = time.perf_counter() - t0
    return sampler.report(1e3 * wall / repeats / max(len(sampler.gaps), 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", required=True, help="a grouped KV file (kvcodec extract of a sliding-window/MLA model)")
    ap.add_argument("--transform", required=True, help="the model's grouped .kvt")
    ap.add_argument("--cases", default="transform:5,transform:8,hevc", help="transform:RATIO or hevc, comma-separated")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--chunk-tokens", type=int, default=None)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="sample every thread's stacks during the default fetches, and cProfile the calling thread's",
    )
    ap.add_argument("--out", type=pathlib.Path, required=True)
    args = ap.parse_args()
    kv, meta = load_kv_file(args.kv)
    if not isinstance(kv, GroupedKV):
        raise SystemExit(f"{args.kv} holds uniform KV: measure it with benchmarks/probes/fetch_restore.py")
    records = [
        measure(kv, c, codec_of(c, args.transform, args.chunk_tokens), args.device, args.repeats, args.profile)
        for c in args.cases.split(",")
    ]
    doc = {
        "command": shlex.join(["python", "benchmarks/probes/grouped_fetch.py", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "groups": [g.name for g in kv.spec.groups],
        "tokens": kv.stop,
        "model": meta.get("model", ""),
        "records": records,
    }
    args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
