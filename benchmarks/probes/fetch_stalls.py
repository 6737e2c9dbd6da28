#!/usr/bin/env python3
"""Probe (issue 21): why a fetch now and then takes several times its usual time. Runs any kvcodec
command line (a `bench ttft-engine run`, say) with these hooks, each printed to stderr as a line
starting `EV <seconds> <thread>`:

- every `PrefixCache.fetch`: its time until the calling thread's stream has run what the fetch
  queued there (the hook waits for that stream; other streams' work, such as a matmul beside it,
  is not waited for) and the CUDA allocator's counters that moved since the last fetch ended (device allocations and frees, syncs of every stream: an emptied cache, by an
  allocation's retry or by an `empty_cache` call between fetches);
- a watchdog: the stack of a fetch still running after --stall-ms (then every 100 ms, 4 times);
- at a stall's first stack, the innermost frames of every other thread not parked in a wait;
- every garbage collection of 10 ms or more;
- every Triton compile or load from Triton's disk cache: the kernel and its specialization key
  (a compile during a timed fetch costs 0.4-0.7 s of ptxas on an H200).

    python benchmarks/probes/fetch_stalls.py --stall-ms 150 -- bench ttft-engine run --dir D ...

Session 56 found with it that the fused epilogue compiled during timed fetches for float16
staging, which the warm-up (bfloat16, the engine's dtype) had not compiled
(benchmarks/results/fetch-h200-s56-stalls.md)."""

from __future__ import annotations

import argparse
import functools
import gc
import site
import sys
import sysconfig
import threading
import time
import traceback

import torch

T0 = time.perf_counter()
_running: dict[int, tuple[float, int]] = {}  # thread id -> (fetch start, stacks printed)
_ALLOCATOR = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
_last: dict[str, int] = {}


def event(*parts: object) -> None:
    name = threading.current_thread().name[:16]
    print(f"EV {time.perf_counter() - T0:.4f} {name}", *parts, file=sys.stderr, flush=True)


def allocator_moves() -> str:
    if not torch.cuda.is_available():
        return ""
    stats = torch.cuda.memory_stats()
    moved = {k: stats.get(k, 0) - _last.get(k, 0) for k in _ALLOCATOR}
    _last.update({k: stats.get(k, 0) for k in _ALLOCATOR})
    return " ".join(f"{k[4:]}={v}" for k, v in moved.items() if v)


def hook_fetch() -> None:
    from kvcodec.fetcher import cache

    fetch = cache.PrefixCache.fetch

    @functools.wraps(fetch)
    def timed(self, *args, **kwargs):  # noqa: ANN001, ANN202
        me = threading.get_ident()
        start = time.perf_counter()
        _running[me] = (start, 0)
        try:
            result = fetch(self, *args, **kwargs)
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()
        finally:
            _running.pop(me, None)
        event(f"fetch ms={(time.perf_counter() - start) * 1e3:.1f} {allocator_moves()}")
        return result

    cache.PrefixCache.fetch = timed


def watch(stall_s: float) -> None:
    while True:
        time.sleep(0.02)
        for tid, (start, printed) in list(_running.items()):
            late = time.perf_counter() - start
            if printed < 4 and late > stall_s + 0.1 * printed:
                _running[tid] = (start, printed + 1)
                frame = sys._current_frames().get(tid)
                if frame is not None:
                    event(f"STALL {late * 1e3:.0f} ms\n" + "".join(traceback.format_stack(frame)[-12:]))
                if printed == 0:
                    event("STALL busy threads\n" + busy_threads(tid))


_STDLIB = sysconfig.get_paths()["stdlib"]
_PACKAGES = tuple(  # site-packages may lie under the stdlib's folder
    {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
)


def parked(frame) -> bool:  # noqa: ANN001
    """Whether a thread's innermost Python frame is a wait of the standard library (a lock's or an
    event's wait, a queue's get, a pool's idle worker, a selector): a thread parked, not working.
    C calls such as time.sleep leave no frame of their own: a sleeping thread shows its caller."""
    where = frame.f_code.co_filename
    return where.startswith(_STDLIB) and not where.startswith(_PACKAGES) and frame.f_code.co_name in (
        "wait", "_wait_for_tstate_lock", "get", "_worker", "select", "poll", "accept",
    )  # fmt: skip


def busy_threads(fetching: int) -> str:
    """The innermost frames of every other thread not parked: what runs while the fetch stalls."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for tid, frame in sys._current_frames().items():
        if tid in (fetching, threading.get_ident()) or parked(frame):
            continue
        out.append(f"-- {names.get(tid, tid)}\n" + "".join(traceback.format_stack(frame)[-5:]))
    return "".join(out) or "(none)\n"


def hook_gc() -> None:
    """Each garbage collection of 10 ms or more (a full collection over many objects can pause every
    thread that needs the interpreter)."""
    started: dict[int, float] = {}

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[info["generation"]] = time.perf_counter()
        elif (t := started.pop(info["generation"], None)) is not None and time.perf_counter() - t >= 0.01:
            event(
                f"GC generation={info['generation']} ms={(time.perf_counter() - t) * 1e3:.1f} collected={info['collected']}"
            )

    gc.callbacks.append(timed)


def hook_triton_compiles() -> None:
    try:
        from triton.runtime import jit
    except ImportError:
        return
    compile_ = jit.JITFunction._do_compile

    def logged(self, key, *args, **kwargs):  # noqa: ANN001, ANN202
        event(f"COMPILE {getattr(self, '__name__', '?')} key={str(key)[:700]}")
        return compile_(self, key, *args, **kwargs)

    jit.JITFunction._do_compile = logged


def main() -> None:
    parser = argparse.ArgumentParser(description="a kvcodec command with fetch-stall hooks", allow_abbrev=False)
    parser.add_argument("--stall-ms", type=float, default=150.0, help="print a fetch's stack after this long")
    ours, args = parser.parse_known_args()
    if args[:1] == ["--"]:
        args = args[1:]
    stall_ms = ours.stall_ms
    hook_fetch()
    hook_triton_compiles()
    hook_gc()
    threading.Thread(target=watch, args=(stall_ms / 1e3,), daemon=True).start()
    from kvcodec.cli.main import main as kvcodec_main

    sys.argv = ["kvcodec", *args]
    kvcodec_main()


if __name__ == "__main__":
    main()
