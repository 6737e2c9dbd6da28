#!/usr/bin/env python3
"""Probe (issue 21): where a fetch's wall time goes, by sampling every thread's stack. Runs any
kvcodec command line (a `bench ttft-engine run`, say); for every `PrefixCache.fetch` it prints the
fetch's time (both sides synchronized) and what the fetch grew in the allocators (pinned blocks
made, their cudaHostAlloc time in us, device segments, reserved bytes), and for each codec's first
and third fetch the 30 most frequent stacks (innermost five frames, by thread name) sampled every
~2 ms while it ran: the first fetch's extra work beside a steady one's.

    python benchmarks/probes/fetch_stacks.py bench ttft-engine run --dir TE --methods kvcodec-transform \
        --target-ratios 5,8 --tokens 32768 --bandwidths 100 --repeat 3 --max-transfer-s 2 --out OUT.json
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
import traceback

import torch

from kvcodec.cli.main import main
from kvcodec.fetcher import cache

SAMPLES: collections.Counter = collections.Counter()
SAMPLING = threading.Event()
SHOWN = (1, 3)  # which fetches of a codec print their stacks


def _sample_forever() -> None:
    me = threading.get_ident()
    while True:
        time.sleep(0.002)
        if not SAMPLING.is_set():
            continue
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident != me:
                frames = reversed(traceback.extract_stack(frame)[-5:])
                where = " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.name}:{f.lineno}" for f in frames)
                SAMPLES[f"{names.get(ident, '?')[:14]} | {where}"] += 1


def _allocators() -> dict:
    host, device = torch.cuda.host_memory_stats(), torch.cuda.memory_stats()
    return {
        "pinned_blocks": host.get("num_host_alloc", 0),
        "host_alloc_us": host.get("host_alloc_time.total") or 0,
        "dev_segments": device.get("segment.all.allocated", 0),
        "dev_reserved": device.get("reserved_bytes.all.current", 0),
    }


def _sampled(fetch):  # noqa: ANN001, ANN202
    fetches: collections.Counter = collections.Counter()

    def sampled_fetch(self, *args, **kwargs):  # noqa: ANN001, ANN202
        codec = self.codec.id[:20]
        fetches[codec] += 1
        torch.cuda.synchronize()
        before = _allocators()
        SAMPLES.clear()
        SAMPLING.set()
        begin = time.perf_counter()
        result = fetch(self, *args, **kwargs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - begin
        SAMPLING.clear()
        grew = {k: v - before[k] for k, v in _allocators().items()}
        print(f"== fetch {codec} #{fetches[codec]} tokens={result.tokens_restored} s={seconds:.4f} {json.dumps(grew)}")
        if fetches[codec] in SHOWN:
            for where, n in SAMPLES.most_common(30):
                print(f"  {n:5d} {where}")
        sys.stdout.flush()
        return result

    return sampled_fetch


if __name__ == "__main__":
    threading.Thread(target=_sample_forever, daemon=True).start()
    cache.PrefixCache.fetch = _sampled(cache.PrefixCache.fetch)
    sys.argv = ["kvcodec", *sys.argv[1:]]
    main()
