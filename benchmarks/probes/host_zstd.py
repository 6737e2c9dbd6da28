#!/usr/bin/env python3
"""Probe (issue 21): how fast one host thread decompresses a transform chunk's zstd samples on this
machine, alone and with 2-16 threads at once, into pinned (CUDA) or plain numpy buffers: whether a
slow host-side decompression in a fetch's phase timeline is the machine's cores or the fetch.

Synthetic samples: 1.44 MB of uint8 symbols (Laplace, scale 2.2, about 3.6 bits each after zstd),
the size of a 256-token Qwen2.5-0.5B chunk's samples at 5x, coded as the transform codec codes them
(zstd_frames at its ZSTD_LEVEL). Or real ones: the zstd-coded seed chunks of each transform method of a
`kvcodec bench ttft-engine prep` directory (real KV values in a target's shape, one chunk's samples each).

Or those of a store that `fetch_restore.py prep` made (--store-dir: each zstd transform case's first 8 chunks).

With --builds, one thread's time per chunk on each libzstd build here: the system's, which the native threads use
(codecs/zstd_native.py), and the one the zstandard package links in.

With --recode, the samples decompressed and coded again with other settings (zstd levels and minimum match
lengths, deflate through isal, lz4): bytes and one thread's decompression time against the codec's own setting,
whether another setting would cost the host's cores less per chunk at no more bytes.

    python benchmarks/probes/host_zstd.py
    python benchmarks/probes/host_zstd.py --engine-dir D --threads 1,8
    python benchmarks/probes/host_zstd.py --engine-dir D --recode
    python benchmarks/probes/host_zstd.py --store-dir D --builds --out OUT.json
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import pathlib
import statistics
import threading
import time

import numpy as np
import torch

from kvcodec.codecs.transform.codec import ZSTD_LEVEL
from kvcodec.codecs.zstd_streams import unzstd_into, zstd_frames

SAMPLES = 1_440_512


def coded_samples(n: int = SAMPLES, streams: int = 8) -> list[tuple[bytes, int]]:
    """Synthetic chunks' sample streams, each with the samples it holds."""
    rng = np.random.default_rng(0)
    symbols = np.clip(np.round(rng.laplace(0, 2.2, n)) + 128, 0, 255).astype(np.uint8)
    return [(zstd_frames(np.roll(symbols, k * 997).tobytes(), ZSTD_LEVEL), n) for k in range(streams)]


def engine_samples(d: pathlib.Path) -> dict[str, list[tuple[bytes, int]]]:
    """Per transform method of a ttft-engine prep directory: its zstd-coded seed chunks' sample
    streams, each with the samples it holds (methods whose chunks are not all zstd-coded: named, left out)."""
    from kvbench import ttft_engine as te
    from kvbench.methods import transform_ratio

    man = json.loads((d / te.MANIFEST).read_text())
    out = {}
    for m in [m for m in man["methods"] if transform_ratio(m) is not None]:
        codec = te.run_codec(m, d, man)
        reads = [codec._read(b) for b in te.seed_blobs(m, d, man, codec)]
        if all(h["coder"] == "zstd" for h, _ in reads):
            out[m] = [(bytes(s["samples"]), codec._restorer.sample_count(h)) for h, s in reads]
        else:
            print(f"{m}: not every chunk's samples are zstd-coded; left out")
    return out


def per_chunk_ms(srcs: list[tuple[bytes, int]], threads: int, reps: int, pinned: bool) -> tuple[float, float]:
    """(median ms one decompression took, wall ms per chunk over all threads)."""
    n = max(count for _, count in srcs)
    outs = [torch.empty(n, dtype=torch.uint8, pin_memory=pinned).numpy() for _ in range(threads)]
    took: list[list[float]] = [[] for _ in range(threads)]

    def work(t: int) -> None:
        for i in range(reps):
            data, count = srcs[(t + i) % len(srcs)]
            t0 = time.perf_counter()
            got = unzstd_into(data, outs[t][:count], "samples")
            took[t].append(time.perf_counter() - t0)
            assert got == count, (got, count)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    t0 = time.perf_counter()
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    wall = time.perf_counter() - t0
    return statistics.median(x for ts in took for x in ts) * 1e3, wall / (reps * threads) * 1e3


def recoders() -> dict[str, tuple]:
    """(compress, decompress) per setting tried by --recode; the codec's own (zstd at ZSTD_LEVEL) first."""
    import lz4.frame
    import zstandard
    from isal import isal_zlib

    def zstd(**params) -> tuple:
        level = params.pop("level", ZSTD_LEVEL)
        p = zstandard.ZstdCompressionParameters.from_level(level, **params)
        return zstandard.ZstdCompressor(compression_params=p).compress, zstandard.ZstdDecompressor().decompress

    out = {f"zstd-{ZSTD_LEVEL}": zstd()}
    out |= {f"zstd-{lv}": zstd(level=lv) for lv in (2, 3, 5, 9) if lv != ZSTD_LEVEL}
    out |= {f"zstd-{ZSTD_LEVEL}-minmatch{m}": zstd(min_match=m) for m in (5, 6)}
    out[f"zstd-{ZSTD_LEVEL}-window17"] = zstd(window_log=17)
    out |= {f"deflate-isal-{lv}": (lambda b, lv=lv: isal_zlib.compress(b, lv), isal_zlib.decompress) for lv in (1, 3)}
    out["lz4"] = (lz4.frame.compress, lz4.frame.decompress)
    return out


def recode(srcs: list[tuple[bytes, int]], reps: int = 7) -> list[dict]:
    """Each recoder's bytes and one thread's decompression ms per chunk, as ratios to the first's."""
    raws = []
    for data, count in srcs:
        buf = np.empty(count, dtype=np.uint8)
        unzstd_into(data, buf, "samples")
        raws.append(buf.tobytes())
    rows = []
    for name, (compress, decompress) in recoders().items():
        coded = [compress(r) for r in raws]
        assert all(decompress(c) == r for c, r in zip(coded, raws)), name
        took = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for c in coded:
                decompress(c)
            took.append((time.perf_counter() - t0) / len(coded))
        rows.append({"setting": name, "bytes": sum(map(len, coded)), "ms_per_chunk": 1e3 * statistics.median(took)})
    for r in rows:
        r["bytes_vs_default"] = round(r["bytes"] / rows[0]["bytes"], 4)
        r["time_vs_default"] = round(r["ms_per_chunk"] / rows[0]["ms_per_chunk"], 3)
        r["ms_per_chunk"] = round(r["ms_per_chunk"], 3)
    return rows


def store_samples(d: pathlib.Path) -> dict[str, list[tuple[bytes, int]]]:
    """Per zstd transform case of a fetch_restore.py store: its first 8 chunks' sample streams and counts."""
    import fetch_restore as fr
    from native_frames import _samples

    from kvbench.pack import read_pack
    from kvcodec.store import open_store

    doc = json.loads((d / "cases.json").read_text())
    store, cal = open_store(f"file://{d / 'store'}"), read_pack(d / fr.PACK)
    zstd_cases = [c for c in doc["cases"] if c["codec"] == "transform" and c.get("coder") in (None, "zstd")]
    return {c["name"]: _samples(d, doc, store, c, cal) for c in zstd_cases}


def package_zstd():  # noqa: ANN201 - a CDLL or None
    """The libzstd that the zstandard package's cffi extension links in and exports (1.5.7 in zstandard 0.25),
    loaded so that its own calls stay within it (RTLD_DEEPBIND: its functions call each other through the PLT, and
    a system libzstd in the global scope would otherwise answer them); None where it cannot be had."""
    from kvcodec import native
    from kvcodec.codecs import zstd_native as zn

    try:
        spec = importlib.util.find_spec("zstandard._cffi")
        mode = ctypes.RTLD_LOCAL | getattr(os, "RTLD_DEEPBIND", 0)
        return (
            None
            if spec is None or not spec.origin
            else native.declare(ctypes.CDLL(spec.origin, mode), zn.ZSTD_SIGNATURES)
        )
    except (ImportError, ValueError, OSError, AttributeError):
        return None


def decode_ms(lib, data: bytes, count: int) -> float:  # noqa: ANN001 - a libzstd CDLL
    """One decompression of a one-frame stream by `lib`, ms (the stream must fill `count` bytes exactly)."""
    out = ctypes.create_string_buffer(count)
    dctx = lib.ZSTD_createDCtx()
    try:
        t0 = time.perf_counter()
        written = lib.ZSTD_decompressDCtx(dctx, out, count, data, len(data))
        took = time.perf_counter() - t0
    finally:
        lib.ZSTD_freeDCtx(dctx)
    if lib.ZSTD_isError(written) or written != count:
        raise RuntimeError(f"libzstd {lib.ZSTD_versionNumber()} did not decompress a chunk's samples")
    return 1e3 * took


def builds(cases: dict[str, list[tuple[bytes, int]]], rounds: int = 7) -> dict:
    """Each libzstd build's one-thread ms per chunk of each case (a chunk's samples in one frame, as kvcodec
    writes them): the median of rounds that take the builds in turn, their order alternating. The native
    threads use the system's build (codecs/zstd_native.py); this says whether the package's would be faster."""
    from kvcodec.codecs import zstd_native as zn

    found = {
        "system": zn.system_zstd(),
        "package": package_zstd(),
    }
    found = {name: lib for name, lib in found.items() if lib is not None}
    streams = {case: [(bytes(data), count) for data, count in chunks] for case, chunks in cases.items()}
    took: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        for build in list(found) if r % 2 == 0 else list(found)[::-1]:
            for case, chunks in streams.items():
                each = [decode_ms(found[build], data, count) for data, count in chunks]
                took.setdefault((build, case), []).append(sum(each) / len(each))
    return {
        "versions": {name: lib.ZSTD_versionNumber() for name, lib in found.items()},
        "rows": [
            {
                "build": b,
                "case": c,
                "ms_per_chunk": round(statistics.median(v), 4),
                "rounds_ms": [round(x, 4) for x in v],
            }
            for (b, c), v in took.items()
        ],
    }


def order0_bits(srcs: list[tuple[bytes, int]]) -> float:
    """The samples' order-0 entropy, bits a sample (what a coder of each byte alone could reach)."""
    counts = np.zeros(256, dtype=np.int64)
    for data, count in srcs:
        buf = np.empty(count, dtype=np.uint8)
        unzstd_into(data, buf, "samples")
        counts += np.bincount(buf, minlength=256)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--engine-dir", type=pathlib.Path, help="a ttft-engine prep directory: its chunks' samples")
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--recode", action="store_true", help="other coders' bytes and decompression time, one thread")
    source.add_argument("--store-dir", type=pathlib.Path, help="a fetch_restore.py store: its chunks' samples")
    ap.add_argument("--builds", action="store_true", help="each libzstd build's time, one thread")
    ap.add_argument("--out", type=pathlib.Path, help="--recode, --builds: also write the rows here (JSON)")
    a = ap.parse_args()
    if a.engine_dir:
        cases = engine_samples(a.engine_dir)
    elif a.store_dir:
        cases = store_samples(a.store_dir)
    else:
        cases = {"synthetic": coded_samples()}
    print(f"cpus {os.cpu_count()} affinity {len(os.sched_getaffinity(0))} level {ZSTD_LEVEL}")
    if a.builds:
        out = builds(cases)
        print(f"versions {out['versions']}")
        for r in out["rows"]:
            print(f"  {r['build']:8s} {r['case']:10s} {r['ms_per_chunk']:.3f} ms a chunk")
        if a.out:
            cmd = "python benchmarks/probes/host_zstd.py " + ("--store-dir D " if a.store_dir else "") + "--builds"
            a.out.write_text(json.dumps({"command": cmd, "cpus": len(os.sched_getaffinity(0)), **out}, indent=1))
        return
    recoded: dict[str, dict] = {}
    for name, srcs in cases.items():
        n = sum(count for _, count in srcs)
        print(f"{name}: {n // len(srcs)} samples a chunk, {8 * sum(len(d) for d, _ in srcs) / n:.2f} bits each")
        if a.recode:
            rows = recode(srcs)
            recoded[name] = {
                "samples_per_chunk": n // len(srcs),
                "bits_per_sample": round(8 * sum(len(d) for d, _ in srcs) / n, 3),
                "order0_bits_per_sample": round(order0_bits(srcs), 3),
                "rows": rows,
            }
            for r in rows:
                print(
                    f"  {r['setting']:22s} bytes {r['bytes_vs_default']:.4f}x  {r['ms_per_chunk']:.3f} ms a chunk "
                    f"({r['time_vs_default']:.2f}x the time)"
                )
            continue
        for pinned in (True, False) if torch.cuda.is_available() else (False,):
            for threads in (int(t) for t in a.threads.split(",")):
                each, wall = per_chunk_ms(srcs, threads, 20, pinned)
                dest = "pinned" if pinned else "numpy"
                print(f"  dest={dest} threads={threads}: {each:.2f} ms each, {wall:.2f} ms/chunk effective")

    if a.out and recoded:
        cmd = "python benchmarks/probes/host_zstd.py --engine-dir D --recode --out OUT.json"
        a.out.write_text(json.dumps({"command": cmd, "cpus": len(os.sched_getaffinity(0)), "cases": recoded}, indent=1))


if __name__ == "__main__":
    main()
