"""A busy GPU beside the thing measured: a bf16 matmul looping on its own stream, as a serving
engine's forward passes keep the SMs busy. `matmul_tflops` is its rate; `beside_matmul` runs a
function in a loop on another thread meanwhile and reports what each did to the other."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable


def matmul_tflops(device, seconds: float, n: int = 8192, batch: int = 20, queued: int = 1) -> float:  # noqa: ANN001
    """TFLOP/s of n^3 bf16 matmuls looping for about `seconds` on a stream of their own, launched
    `batch` at a time. queued: batches on the stream while its thread waits. 1 waits for each batch
    before launching the next, so the stream idles while the thread waits for the interpreter lock
    (what a Python-launched engine step loses beside a fetch's thread); 2 or more keep a batch queued
    meanwhile, so only the GPU's sharing (SMs, memory, copy engines) slows the matmul."""
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty_like(a)
    s = torch.cuda.Stream(device)
    with torch.cuda.stream(s):
        for _ in range(3):
            torch.matmul(a, b, out=c)
        s.synchronize()
        t0 = time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(s)
        iters, in_flight = 0, collections.deque()
        while time.perf_counter() - t0 < seconds:
            for _ in range(batch):
                torch.matmul(a, b, out=c)
            iters += batch
            in_flight.append(torch.cuda.Event())
            in_flight[-1].record(s)
            if len(in_flight) >= max(1, queued):
                in_flight.popleft().synchronize()
        end.record(s)
        s.synchronize()
    return 2.0 * n**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12


def beside_matmul(
    fn: Callable[[], object], device, seconds: float, alone: float, settle_s: float = 0.3, **matmul
) -> dict:  # noqa: ANN001
    """The matmul's rate while `fn` runs in a loop on another thread, against `alone` (its rate with
    nothing beside it, measured by the caller in the same run with the same `matmul` options of
    matmul_tflops), and `fn`'s calls meanwhile."""
    stop = threading.Event()
    calls = [0]
    errors: list[str] = []

    def loop() -> None:
        try:
            while not stop.is_set():
                fn()
                calls[0] += 1
        except Exception as e:  # noqa: BLE001 - reported in the record
            errors.append(repr(e))

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    time.sleep(settle_s)  # fn's first call (and any warm-up it does) is not what is measured
    c0, t0 = calls[0], time.perf_counter()
    during = matmul_tflops(device, seconds, **matmul)
    c1, t1 = calls[0], time.perf_counter()
    stop.set()
    t.join()
    return {
        "matmul_tflops_alone": alone,
        "matmul_tflops_during": during,
        "matmul_slowdown": 1.0 - during / alone,
        "calls_during": c1 - c0,
        "call_s_during": (t1 - t0) / max(c1 - c0, 1),
        **({"error": errors[0]} if errors else {}),
    }
