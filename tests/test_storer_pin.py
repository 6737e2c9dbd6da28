"""Stores kept off the engine's way (issue 24, target 2): encode worker processes pinned to the
cores not left to serving. Real worker processes; their threads' CPUs read from the kernel."""

from __future__ import annotations

import os
import sys

import pytest

from kvcodec.codecs.raw import RawCodec
from kvcodec.engine.storer import KVStorer, StorePolicy, affinity, encode_cpus, serving_cores
from kvcodec.fetcher import PrefixCache
from kvcodec.store import open_store

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU affinity per thread (/proc)")


def test_encode_cpus_leave_the_first_serving_cores_to_the_engine():
    assert encode_cpus(range(16)) == tuple(range(4, 16))  # a quarter left to serving
    assert encode_cpus([9, 3, 5, 7]) == (5, 7, 9)  # the serving process's own CPUs, in order
    assert encode_cpus([0, 1]) == (1,)
    assert encode_cpus([2]) is None and encode_cpus([]) is None  # nothing to leave: not pinned
    for n in (2, 3, 8, 64):
        cpus = encode_cpus(range(n))
        assert len(cpus) == n - serving_cores(n) and not set(cpus) & set(range(serving_cores(n)))


def raw_storer(tmp_path, **policy) -> KVStorer:
    url = f"file://{tmp_path / 'store'}"
    cache = PrefixCache(open_store(url), "m", RawCodec(chunk_tokens=4), "cpu")
    return KVStorer(cache, StorePolicy(encode_workers=2, encode_processes=2, **policy), 4, store_url=url)


def started(storer: KVStorer) -> tuple[int, ...]:
    storer.start()
    storer.flush()  # every worker up
    pids = storer.processes.pids()
    assert len(pids) == 2 and os.getpid() not in pids
    return pids


@linux_only
def test_workers_run_only_on_the_cores_not_left_to_serving(tmp_path):
    cpus = encode_cpus(affinity())
    if cpus is None or not hasattr(os, "sched_getaffinity"):
        pytest.skip("one CPU: nothing to pin")
    storer = raw_storer(tmp_path)
    try:
        assert storer.processes.spec.cpus == cpus
        for pid in started(storer):
            for tid in os.listdir(f"/proc/{pid}/task"):  # every thread of the worker
                assert os.sched_getaffinity(int(tid)) == set(cpus)
    finally:
        storer.shutdown()
    unpinned = raw_storer(tmp_path, pin=False)
    try:
        assert unpinned.processes.spec.cpus is None
        assert all(os.sched_getaffinity(pid) == set(affinity()) for pid in started(unpinned))
    finally:
        unpinned.shutdown()
