"""Storing while serving is background work (issue 24): the storer's threads and their encode
threads run at a lower OS priority where the OS allows it, one store's chunks are encoded by the
configured worker count, and what is stored is byte-identical to a foreground encode. Real
PrefixCaches (memory store), real x265; no timing: thread ids and niceness are read from the OS."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from kvcodec import CodecConfig
from kvcodec.codecs.hevc.codec import HevcCodec
from kvcodec.codecs.hevc.encode import Background, background, background_settings, in_order, lower_priority
from kvcodec.engine import EngineConfig
from kvcodec.engine.storer import KVStorer, StorePolicy, default_store_workers, serving_cores
from kvcodec.errors import ConfigError
from kvcodec.fetcher import PrefixCache
from kvcodec.fetcher.keys import blob_key, meta_key
from kvcodec.store import open_store

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
CONFIG = CodecConfig(quant="int8", chunk_tokens=16, resolutions=((144, 144),), video_bits=8)


def process_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, os.getpid())


def thread_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def in_thread(fn):
    """fn() on a new thread (niceness set there never touches the test's own thread)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def kv_of(tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, tokens, 2, 32, generator=g).half()


@linux
def test_lower_priority_lowers_only_the_calling_thread_and_never_raises_it():
    base = process_nice()
    if base >= 19:
        pytest.skip("the process already runs at the lowest priority")

    def lowered():
        done = lower_priority(3)
        after = thread_nice()
        lower_priority(1)  # asks for less than it has: stays
        return done, after, thread_nice()

    assert in_thread(lowered) == (True, min(19, base + 3), min(19, base + 3))
    assert thread_nice() == base and lower_priority(0) is False


@linux
def test_background_encode_threads_are_capped_and_lowered():
    base = process_nice()
    seen = []

    def record(i: int):
        seen.append((threading.current_thread().name, thread_nice(), background_settings()))
        return i

    def run():
        with background(Background(workers=2, nice=4)):
            assert background_settings() == Background(2, 4)
            return list(in_order(record, 6, workers=8)), thread_nice()

    order, caller_nice = in_thread(run)
    assert order == list(range(6)) and caller_nice == min(19, base + 4)
    names = {name for name, _, _ in seen}
    assert 1 <= len(names) <= 2 and all(n.startswith("kvcodec-encode") for n in names)
    assert {nice for _, nice, _ in seen} == {min(19, base + 4)}
    assert background_settings() is None  # the setting is the encoding thread's, not global


def test_default_store_workers_leave_the_serving_process_a_quarter_of_the_cores(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("KVCODEC_ENCODE_WORKERS", raising=False)
    assert [serving_cores(n) for n in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 16]
    assert default_store_workers() == max(1, cores - serving_cores(cores))
    assert StorePolicy().background() == Background(max(1, cores - serving_cores(cores)), 10)
    assert StorePolicy(encode_workers=3, nice=0).background() == Background(3, 0)
    monkeypatch.setenv("KVCODEC_ENCODE_WORKERS", "1")
    assert default_store_workers() == 1
    assert EngineConfig().store_policy.nice == 10  # the engine's default stores in the background


@pytest.mark.parametrize("field, bad", [("encode_workers", 0), ("encode_workers", 1.5), ("nice", -1), ("nice", 20)])
def test_store_policy_background_fields_are_validated(field, bad):
    with pytest.raises(ConfigError):
        StorePolicy(**{field: bad})


class RecordingCache(PrefixCache):
    """A real PrefixCache (HEVC codec, memory store) recording the thread each put runs on."""

    def __init__(self) -> None:
        super().__init__(open_store("memory://"), "m", HevcCodec(CONFIG), "cpu")
        self.threads = []

    def put(self, token_ids, kv):
        self.threads.append((threading.current_thread().name, thread_nice(), background_settings()))
        return super().put(token_ids, kv)


def stored_bytes(cache: PrefixCache, ids: list[int]) -> list[bytes]:
    keys = cache.keys(ids)
    return [cache.store.get(meta_key(k)) for k in keys] + [cache.store.get(blob_key(k, 0)) for k in keys]


def test_a_background_store_is_byte_identical_to_a_foreground_encode():
    ids, kv = list(range(48)), kv_of(48)
    fore = PrefixCache(open_store("memory://"), "m", HevcCodec(CONFIG), "cpu")
    assert fore.put(ids, kv) == 3
    cache = RecordingCache()
    storer = KVStorer(cache, StorePolicy(encode_workers=2, nice=5), CONFIG.chunk_tokens)
    try:
        layers = [(kv[i, 0].permute(1, 0, 2)[None], kv[i, 1].permute(1, 0, 2)[None]) for i in range(kv.shape[0])]
        assert storer.submit(ids, layers).result(timeout=120) == 3
    finally:
        storer.shutdown()
    assert stored_bytes(cache, ids) == stored_bytes(fore, ids) and all(stored_bytes(fore, ids))
    ((name, nice, settings),) = cache.threads
    assert name.startswith("kvcodec-store") and settings == Background(2, 5)
    if sys.platform.startswith("linux"):
        assert nice == min(19, process_nice() + 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_store_of_cuda_kv_runs_on_the_storers_own_stream_and_matches_a_foreground_encode():
    ids, kv = list(range(48)), kv_of(48).cuda()
    fore = PrefixCache(open_store("memory://"), "m", HevcCodec(CONFIG), "cuda")
    fore.put(ids, kv)
    streams = []

    class StreamCache(RecordingCache):
        def put(self, token_ids, kv):
            streams.append(torch.cuda.current_stream(kv.device))
            return super().put(token_ids, kv)

    cache = StreamCache()
    storer = KVStorer(cache, StorePolicy(), CONFIG.chunk_tokens)
    try:
        layers = [(kv[i, 0].permute(1, 0, 2)[None], kv[i, 1].permute(1, 0, 2)[None]) for i in range(kv.shape[0])]
        assert storer.submit(ids, layers).result(timeout=120) == 3
    finally:
        storer.shutdown()
    assert streams and streams[0] != torch.cuda.default_stream(kv.device)
    assert stored_bytes(cache, ids) == stored_bytes(fore, ids)
