#!/usr/bin/env python3
"""Probe (issue 21): the native zstd threads' time to decompress a fetch's first 1, 2 and 8 chunks'
samples, submitted at once (median of rounds that take the cases in turn), for every transform case of a
store prepared by fetch_restore.py: the same KV and calibration with the samples in frames of several
sizes (`zframe`; without it, the default: one frame a chunk). benchmarks/results/fetch-h100-s62-frames.md:

    python benchmarks/probes/fetch_restore.py prep --model qwen2.5-coder-0.5b --dir D --tokens 2048 \\
        --text pg/gap,pg/love,pg/web20 --cases t5f:ratio=5,coder=zstd,zframe=524288 --cases t5z:ratio=5,coder=zstd \\
        --cases t8f:ratio=8,coder=zstd,zframe=524288 --cases t8z:ratio=8,coder=zstd
    python benchmarks/probes/native_frames.py D THREADS [OUT.json]
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

import fetch_restore as fr
import numpy as np

from kvbench.pack import read_pack
from kvcodec.codecs import zstd_native
from kvcodec.fetcher import PrefixCache
from kvcodec.store import open_store

COUNTS = (1, 2, 8)
REPEAT = 20  # fetches a round (after 5 warm-ups): their median is the round's
ROUNDS = 6


def _samples(d: pathlib.Path, doc: dict, store, case: dict, cal) -> list[tuple[bytes, int]]:  # noqa: ANN001
    """The case's first 8 chunks' samples streams and sample counts, in order."""
    codec = fr.make_codec(case, d, cal)
    cache = PrefixCache(store, doc["model"], codec, "cpu", namespace=case.get("ns"))
    out = []
    for key in cache.keys(doc["ids"])[:8]:
        h, _, streams = codec._read_entries(store.get(key + "/r0"), ())
        out.append((streams["samples"], codec._restorer.sample_count(h)))
    return out


def _median_ms(pool, chunks: list[tuple[bytes, int]]) -> float:  # noqa: ANN001
    bufs = [np.empty(n, np.uint8) for _, n in chunks]

    def once() -> float:
        t = time.perf_counter()
        for f in [pool.submit(s, b, "samples") for (s, _), b in zip(chunks, bufs)]:
            f.result()
        return time.perf_counter() - t

    for _ in range(5):
        once()
    return statistics.median(once() for _ in range(REPEAT)) * 1e3


def main() -> None:
    d, threads = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    doc = json.loads((d / "cases.json").read_text())
    pool = zstd_native.threads(lambda: threads)
    if pool is None:
        sys.exit("no native zstd threads here")
    store, cal = open_store(f"file://{d / 'store'}"), read_pack(d / "transform.pack.safetensors")
    cases = {c["name"]: c for c in doc["cases"] if c["codec"] == "transform" and c.get("coder") in (None, "zstd")}
    names = list(cases)
    chunks = {name: _samples(d, doc, store, cases[name], cal) for name in names}
    runs: dict[tuple[str, int], list[float]] = {(name, n): [] for name in names for n in COUNTS}
    for r in range(ROUNDS):  # the cases in turn, in alternating order: a drifting machine favours none
        for name in names if r % 2 == 0 else names[::-1]:
            for n in COUNTS:
                runs[(name, n)].append(_median_ms(pool, chunks[name][:n]))
    out = {"command": "python " + " ".join(sys.argv), "threads": pool.threads, "repeat": REPEAT, "rounds": ROUNDS}
    out["rows"] = [
        {
            "case": name,
            "ratio_vs_fp16": cases[name]["ratio_vs_fp16"],
            "chunks": n,
            "ms": round(statistics.median(v), 3),
            "rounds_ms": [round(x, 3) for x in v],
        }
        for (name, n), v in runs.items()
    ]
    for row in out["rows"]:
        print(f"{row['case']} ({row['ratio_vs_fp16']}x) {row['chunks']} chunk(s): {row['ms']:.3f} ms", flush=True)
    if len(sys.argv) > 3:
        pathlib.Path(sys.argv[3]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
