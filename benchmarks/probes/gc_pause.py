#!/usr/bin/env python3
"""Probe (issue 21): how long a full garbage collection pauses every thread of a serving process, with
and without the engine's freeze (engine/gcfreeze.py). Starts `Engine(MODEL)` with freeze_gc off,
counts the collector's tracked objects, times `gc.collect()` (a full collection, as the collector's
own generation-2 runs) REPEAT times, then freezes as an engine's start does and times it again.

    python benchmarks/probes/gc_pause.py [MODEL] [--device cpu|cuda] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from kvcodec.engine import Engine, gcfreeze


def full_collections_ms(repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with Engine(args.model, device=args.device, freeze_gc=False) as engine:
        engine.generate(["warm the engine up"], max_new_tokens=2)
        tracked = len(gc.get_objects())
        before = full_collections_ms(args.repeat)
        gcfreeze.hold()
        try:
            frozen = gc.get_freeze_count()
            after = full_collections_ms(args.repeat)
        finally:
            gcfreeze.release()
    med = statistics.median
    print(f"model {args.model} on {args.device}: {tracked} tracked objects after start-up and one request")
    print(f"full collection, nothing frozen: median {med(before):.1f} ms, {min(before):.1f}-{max(before):.1f} ms")
    print(f"full collection, {frozen} frozen: median {med(after):.2f} ms, {min(after):.2f}-{max(after):.2f} ms")


if __name__ == "__main__":
    main()
