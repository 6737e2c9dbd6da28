#!/usr/bin/env python3
"""Probe (issue 21): the phase timeline of default CUDA fetches. Each step of the fetch (plan,
driver, reads on the network threads, submits, host zstd jobs, waits, stage, finish) is timed by
wrapping it; the table gives, per step, when it first began and last ended relative to the call
and its summed time (median over 30 fetches after 5 warm-ups): where the fetch's critical path goes.

    # a store prepared by fetch_restore.py prep (its cases.json and pack carried to the GPU machine)
    python benchmarks/probes/fetch_phases.py D 2048 t5m,t5z,t5h OUT.json

Columns: first_b (ms from the call to the step's first start), last_e (to its last end), n (calls),
sum_ms (their summed time; for @host and @net steps summed over threads that run at once). @host: the
host pool's threads (zstd'd chunks); @net: the fetch's pool threads (its network stage, and its decode
workers where the restore is not driven, and the thread collecting the native zstd jobs); Z.job@native:
each native zstd job from when a C thread took it to when it ended (their own clock)."""

from __future__ import annotations

import contextlib
import functools
import json
import pathlib
import statistics
import sys
import threading
import time

import fetch_restore as fr
import torch

from kvcodec.codecs import driven, zstd_native, zstd_streams
from kvcodec.codecs.transform import batch as transform_batch
from kvcodec.codecs.transform import decode as transform_decode
from kvcodec.container import format as container_format
from kvcodec.fetcher import PrefixCache
from kvcodec.fetcher import pipeline as pl
from kvcodec.restore import transform_kernels, transform_triton

EVENTS: list[tuple[str, str, float, str]] = []  # (step, "b" | "e", time, thread)


def _record(name: str, kind: str) -> None:
    EVENTS.append((name, kind, time.perf_counter(), threading.current_thread().name))


def _wrap(owner, attr: str, name: str | None = None) -> None:  # noqa: ANN001
    fn, name = getattr(owner, attr), name or attr

    @functools.wraps(fn)
    def timed(*a, **k):  # noqa: ANN202
        _record(name, "b")
        try:
            return fn(*a, **k)
        finally:
            _record(name, "e")

    setattr(owner, attr, timed)


def _wrap_cm(owner, attr: str) -> None:  # noqa: ANN001
    fn = getattr(owner, attr)

    @contextlib.contextmanager
    def timed(*a, **k):  # noqa: ANN202
        _record(attr + ".enter", "b")
        with fn(*a, **k) as v:
            _record(attr + ".enter", "e")
            yield v
            _record(attr + ".exit", "b")
        _record(attr + ".exit", "e")

    setattr(owner, attr, timed)


def _record_native_jobs() -> None:
    """Each native zstd job's own span, from its C threads' clock (CLOCK_MONOTONIC, which
    time.perf_counter reads), as step Z.job: when a thread took it and when it ended, before the
    collecting thread settles it (a tree whose jobs keep no times records none)."""
    settle = zstd_native._settle

    def timed(p, zstd):  # noqa: ANN001, ANN202
        began, ended = getattr(p.job, "began_ns", 0), getattr(p.job, "ended_ns", 0)
        if began and ended:
            EVENTS.extend((("Z.job", "b", began / 1e9, "zstd-native"), ("Z.job", "e", ended / 1e9, "zstd-native")))
        return settle(p, zstd)

    zstd_native._settle = timed


def instrument() -> None:
    for a in ("_plan", "_profile_for", "decoder_name", "_result", "_check_out"):
        _wrap(PrefixCache, a)
    for a in ("__init__", "_consume_driven", "_submit", "_restore_run", "_finish", "_get", "_shutdown", "_advance"):
        _wrap(pl.FetchPipeline, a, "P." + a)
    for a in ("_new_output", "_finish_stats"):
        _wrap(pl.FetchPipeline, a, "P." + a)
    for a in ("submit_many", "close", "wait", "poll", "prepare_one", "_collect_host", "_push", "_host"):
        _wrap(driven.StageDriver, a, "D." + a)
    for a in ("prepare_host", "read", "stage", "begin_host", "_native_job", "_staging"):
        if hasattr(transform_batch.TransformDriven, a):  # begin_host: since session 67
            _wrap(transform_batch.TransformDriven, a, "T." + a)
    if hasattr(driven.StageDriver, "begin"):  # since session 67
        _wrap(driven.StageDriver, "begin", "D.begin")
    _wrap(zstd_native.ZstdThreads, "submit", "Z.submit")
    _wrap(zstd_native, "frame_spans", "Z.frame_spans")
    # inside prepare_host: the checksums, the samples' pinned buffer and their zstd (host_samples less
    # unzstd_into: the pinned allocation)
    for a in ("_verify", "host_samples"):
        _wrap(transform_batch, a, "T." + a)
    _wrap(transform_decode, "unzstd_into", "T.unzstd_into")
    _wrap(container_format, "crc32", "C.crc32")
    _wrap(zstd_streams, "_decompress", "Z._decompress")
    _wrap(zstd_native, "_settle", "Z._settle")  # on the native threads' collecting thread: a chunk's job done
    _record_native_jobs()
    # inside finish: the batched restore's host side (tables, uploads, the launches) and its kernels' calls
    _wrap(transform_decode.TransformRestorer, "_finish_group", "F._finish_group")
    for a in ("restore_into", "_fused", "escape_slots", "upload", "_upload", "_gathered_at", "_half_gemm_of"):
        if hasattr(transform_kernels, a):  # upload: _upload before session 68 (an A/B's older tree)
            _wrap(transform_kernels, a, "F." + a)
    for a in ("meta_table", "supports", "launch", "gather_centred"):
        _wrap(transform_triton, a, "F." + a)
    _wrap(transform_decode, "_sinks_on", "F._sinks_on")
    _wrap_cm(driven, "stage_driver")
    _wrap_cm(pl, "_own_stream")


def _step(name: str, thread: str) -> str:
    if thread == "MainThread":
        return name
    if thread == "zstd-native":
        return name + "@native"
    return name + ("@host" if thread.startswith("kvcodec-host") else "@net")


def one_fetch(cache, ids: list[int], caller) -> tuple[dict, float]:  # noqa: ANN001
    """Per step of one fetch: (first start, last end, calls, summed seconds); and the call's seconds."""
    EVENTS.clear()
    t0 = time.perf_counter()
    with torch.cuda.stream(caller):
        r = cache.fetch(ids, deadline_s=None)
    caller.synchronize()
    call = time.perf_counter() - t0
    if not r.ok:
        raise RuntimeError(f"fetch failed: {r.error}")
    steps: dict[str, list] = {}
    began: dict[tuple[str, str], float] = {}
    for name, kind, t, thread in EVENTS:
        key = _step(name, thread)
        s = steps.setdefault(key, [t - t0, 0.0, 0, 0.0])
        if kind == "b":
            began[(key, thread)] = t
            s[0] = min(s[0], t - t0)  # Z.job's events come in the order settled, not begun
            continue
        s[1], s[2] = max(s[1], t - t0), s[2] + 1
        s[3] += t - began.pop((key, thread), t)
    return steps, call


def _pack_of(d: pathlib.Path, case: dict):  # noqa: ANN202 - the calibration read_pack gives, or None
    """The cut calibration that travels with D (prep's pack) for a transform case, else None (the .kvt beside D)."""
    pack = d / fr.PACK
    return fr.read_pack(pack) if case["codec"].startswith("transform") and pack.exists() else None


def case_table(d: pathlib.Path, doc: dict, mem, name: str, tokens: int) -> dict:  # noqa: ANN001
    case = next(c for c in doc["cases"] if c["name"] == name)
    cache = PrefixCache(mem, doc["model"], fr.make_codec(case, d, _pack_of(d, case)), "cuda", namespace=case.get("ns"))
    ids, caller = doc["ids"][:tokens], torch.cuda.Stream()
    fr.fetch_loop(cache, ids, 5)
    runs = [one_fetch(cache, ids, caller) for _ in range(30)]
    t0 = min(t for _, _, t, _ in EVENTS)
    events = [(n, k, round((t - t0) * 1e3, 4), th) for n, k, t, th in EVENTS]
    med = statistics.median
    keys = sorted({k for r in runs for k in r[0]}, key=lambda k: med(r[0][k][0] for r in runs if k in r[0]))
    rows = [
        [
            k,
            *(
                round(med(r[0][k][c] for r in runs if k in r[0]) * f, 3)
                for c, f in ((0, 1e3), (1, 1e3), (2, 1), (3, 1e3))
            ),
        ]
        for k in keys
    ]
    call_ms = med(r[1] for r in runs) * 1e3
    gb = tokens * doc["fp16_bytes"] / len(doc["ids"]) / 1e9
    return {
        "case": name,
        "tokens": tokens,
        "call_ms": round(call_ms, 3),
        "gb_per_s": round(gb / call_ms * 1e3, 3),
        "rows": rows,
        "last_events": events,
    }


def main() -> None:
    d, tokens, names, out = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
    instrument()
    doc = json.loads((d / "cases.json").read_text())
    if not 0 < tokens <= len(doc["ids"]):
        sys.exit(f"the store holds {len(doc['ids'])} tokens; asked for {tokens}")
    mem = fr._memory_store(d, doc)
    tables = []
    for name in names:
        t = case_table(d, doc, mem, name, tokens)
        tables.append(t)
        print(f"== {name} tokens={tokens} call_ms={t['call_ms']:.3f} GB/s={t['gb_per_s']:.2f}")
        print(f"{'step':32s} {'first_b':>8s} {'last_e':>8s} {'n':>4s} {'sum_ms':>8s}")
        for step, first, last, n, total in t["rows"]:
            print(f"{step:32s} {first:8.3f} {last:8.3f} {n:4} {total:8.3f}")
    pathlib.Path(out).write_text(json.dumps({"command": " ".join(sys.argv), "tables": tables}, indent=1))


if __name__ == "__main__":
    main()
