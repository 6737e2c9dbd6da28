#!/usr/bin/env python3
"""Probe (issue 21): raw fp16 chunks through PrefixCache.fetch from a memory:// store, Llama-3-8B's
KV shape (32 layers, 8 KV heads, head_dim 128: 32 MiB per 256-token chunk), into a dense target and
into the engine's cache layout ([L, 2, H, T, D] seen as (L, 2, T, H, D), fp16 direct or bf16 staged),
with the fetch's defaults; optionally the same fetches through an earlier codecs/raw.py, same store.

    git show 896d885:src/kvcodec/codecs/raw.py > /tmp/raw_before.py   # the raw codec before 02168a9
    python benchmarks/probes/raw_fetch.py --device cuda --tokens 8192 --before /tmp/raw_before.py
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import time

import torch

from kvcodec.codecs import raw as current
from kvcodec.fetcher import PrefixCache
from kvcodec.store import open_store

L, H, D = 32, 8, 128
TARGETS = ("engine-bf16", "engine-fp16", "dense-fp16")


def load_module(path: str):  # noqa: ANN201 - a module
    spec = importlib.util.spec_from_file_location("raw_before", pathlib.Path(path))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["raw_before"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def target(kind: str, tokens: int, device: str) -> torch.Tensor:
    if kind == "dense-fp16":
        return torch.empty((L, 2, tokens, H, D), dtype=torch.float16, device=device)
    dtype = torch.bfloat16 if kind == "engine-bf16" else torch.float16
    return torch.empty((L, 2, H, tokens, D), dtype=dtype, device=device).transpose(2, 3)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_rate(device: str) -> str:
    """The pinned host-to-device copy alone (GB/s), the bound a raw restore can approach."""
    if not device.startswith("cuda"):
        return "-"
    x = torch.empty(1 << 28, dtype=torch.uint8, pin_memory=True)
    y = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    y.copy_(x)
    sync(device)
    t = time.perf_counter()
    y.copy_(x, non_blocking=True)
    sync(device)
    return f"{x.numel() / (time.perf_counter() - t) / 1e9:.1f}"


def measure(mod, store, ids: list[int], kv: torch.Tensor, device: str, repeat: int) -> None:  # noqa: ANN001
    pc = PrefixCache(store, "m", mod.RawCodec(), device, policy="fixed:0")
    gb = kv.numel() * kv.element_size() / 1e9
    for kind in TARGETS:
        out = target(kind, len(ids), device)
        r = pc.fetch(ids, out=out)  # first use: pinned blocks, threads
        assert r.ok and torch.equal(out.cpu(), kv.to(out.dtype)), r.error
        times = []
        for _ in range(repeat):
            sync(device)
            t = time.perf_counter()
            assert pc.fetch(ids, out=out).ok
            sync(device)
            times.append(time.perf_counter() - t)
        runs = ", ".join(f"{v * 1e3:.0f}" for v in times)
        print(
            f"{mod.__name__} {kind}: {pc.decode_workers} decode threads, best {min(times) * 1e3:.0f} ms = "
            f"{gb / min(times):.2f} GB/s (runs {runs} ms)",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--before", default=None, help="An earlier codecs/raw.py to measure first.")
    args = ap.parse_args()
    kv = (torch.randn((L, 2, args.tokens, H, D)) * 0.5).half()
    ids = list(range(100, 100 + args.tokens))
    store = open_store("memory://")
    PrefixCache(store, "m", current.RawCodec(), "cpu", policy="fixed:0").put(ids, kv)
    print(f"pinned H2D alone: {copy_rate(args.device)} GB/s; {args.tokens} tokens = {kv.numel() * 2 / 1e9:.2f} GB fp16")
    for mod in ([load_module(args.before)] if args.before else []) + [current]:
        measure(mod, store, ids, kv, args.device, args.repeat)


if __name__ == "__main__":
    main()
