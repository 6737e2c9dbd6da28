#!/usr/bin/env python3
"""Probe (issue 21): how fast one host thread decompresses a transform chunk's zstd samples on this
machine, alone and with 2-16 threads at once, into pinned (CUDA) or plain numpy buffers: whether a
slow host-side decompression in a fetch's phase timeline is the machine's cores or the fetch.

Synthetic samples: 1.44 MB of uint8 symbols (Laplace, scale 2.2, about 3.6 bits each after zstd),
the size of a 256-token Qwen2.5-0.5B chunk's samples at 5x, coded as the transform codec codes them
(zstd_frames at its ZSTD_LEVEL).

    python benchmarks/probes/host_zstd.py
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import numpy as np
import torch

from kvcodec.codecs.transform.codec import ZSTD_LEVEL
from kvcodec.codecs.zstd_streams import unzstd_into, zstd_frames

SAMPLES = 1_440_512


def coded_samples(n: int = SAMPLES, streams: int = 8) -> list[bytes]:
    rng = np.random.default_rng(0)
    symbols = np.clip(np.round(rng.laplace(0, 2.2, n)) + 128, 0, 255).astype(np.uint8)
    return [zstd_frames(np.roll(symbols, k * 997).tobytes(), ZSTD_LEVEL) for k in range(streams)]


def per_chunk_ms(srcs: list[bytes], threads: int, reps: int, pinned: bool) -> tuple[float, float]:
    """(median ms one decompression took, wall ms per chunk over all threads)."""
    outs = [torch.empty(SAMPLES, dtype=torch.uint8, pin_memory=pinned).numpy() for _ in range(threads)]
    took: list[list[float]] = [[] for _ in range(threads)]

    def work(t: int) -> None:
        for i in range(reps):
            t0 = time.perf_counter()
            unzstd_into(srcs[(t + i) % len(srcs)], outs[t], "samples")
            took[t].append(time.perf_counter() - t0)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    t0 = time.perf_counter()
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    wall = time.perf_counter() - t0
    return statistics.median(x for ts in took for x in ts) * 1e3, wall / (reps * threads) * 1e3


def main() -> None:
    srcs = coded_samples()
    bits = 8 * len(srcs[0]) / SAMPLES
    print(f"cpus {os.cpu_count()} affinity {len(os.sched_getaffinity(0))} level {ZSTD_LEVEL} bits/sample {bits:.2f}")
    for pinned in (True, False) if torch.cuda.is_available() else (False,):
        for threads in (1, 2, 4, 8, 16):
            each, wall = per_chunk_ms(srcs, threads, 20, pinned)
            dest = "pinned" if pinned else "numpy"
            print(f"dest={dest} threads={threads}: {each:.2f} ms each, {wall:.2f} ms/chunk effective")


if __name__ == "__main__":
    main()
