"""The engine's store policy when encoding cannot keep up: most valuable prefixes first (seen by
more prompts, then longer), a bounded backlog that drops the least valuable, min_seen, and the
counts behind /metrics. A real PrefixCache (raw codec, memory store); the encoder is held back by
a gate so that the backlog fills deterministically."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from kvcodec.codecs import make_codec
from kvcodec.engine.metrics import EngineMetrics
from kvcodec.engine.storer import KVStorer, PrefixCounts, StorePolicy, gather_kv
from kvcodec.errors import ConfigError, ShapeError
from kvcodec.fetcher import PrefixCache
from kvcodec.integrations.hf import cache_to_tensor
from kvcodec.store import open_store

CT = 4  # chunk tokens


class GatedCache(PrefixCache):
    """A real PrefixCache whose puts say they have begun (`entered`), wait for `gate` and record
    their order."""

    def __init__(self) -> None:
        super().__init__(open_store("memory://"), "m", make_codec("raw", chunk_tokens=CT), "cpu")
        self.entered, self.gate, self.order = threading.Event(), threading.Event(), []

    def put(self, token_ids, kv):
        self.entered.set()
        assert self.gate.wait(30)
        self.order.append(tuple(token_ids))
        return super().put(token_ids, kv)


def cache_of(tokens: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(1, 2, tokens, 8, generator=g).half() for _ in range(2)) for _ in range(2)]


def prompt(first: int, tokens: int) -> list[int]:
    return list(range(first, first + tokens))


def test_backlog_keeps_the_most_valuable_and_runs_them_first():
    cache = GatedCache()
    storer = KVStorer(cache, StorePolicy(), CT, max_pending=3)
    try:
        running = storer.submit(prompt(0, 8), cache_of(8))
        assert cache.entered.wait(30)  # taken by the worker, which waits at the gate: out of the backlog
        short = storer.submit(prompt(100, 8), cache_of(8))
        long = storer.submit(prompt(200, 16), cache_of(16))
        shared = prompt(300, 8)
        first = storer.submit(shared + [1, 2, 3, 4], cache_of(12))  # the backlog is full: the short one goes
        assert short.done() and short.result() is None and storer.dropped == 1
        again = storer.submit(shared + [5, 6, 7, 8], cache_of(12))  # its first 8 tokens seen twice
        assert first.done() and first.result() is None and storer.dropped == 2  # 3 chunks seen once
        assert storer.submit(prompt(400, 4), cache_of(4)) is None and storer.dropped == 3  # worth least
        assert storer.backlog == 3 and storer.backlog_tokens == 28
        cache.gate.set()
        storer.flush()
        assert running.result() == 2 and again.result() == 3 and long.result() == 4
        assert [len(o) for o in cache.order] == [8, 12, 16] and cache.order[1][-1] == 8  # popular, then long
        assert storer.stored_prefixes == 3 and storer.stored_tokens == 36
    finally:
        cache.gate.set()
        storer.shutdown()


def test_min_seen_stores_only_the_chunks_prompts_share():
    cache = GatedCache()
    cache.gate.set()
    storer = KVStorer(cache, StorePolicy(min_seen=2), CT)
    doc = prompt(0, 10)  # two whole chunks and a half
    assert storer.submit(doc + [50, 51, 52], cache_of(13)) is None and storer.skipped == 1
    f = storer.submit(doc + [60, 61], cache_of(12))
    assert f.result() == 2 and cache.order == [tuple(doc[:8])]
    storer.shutdown()


def test_prefix_counts_follow_the_chunk_chain_and_stay_bounded():
    counts = PrefixCounts(CT, capacity=4)
    assert counts.observe(prompt(0, 12), 3) == [1, 1, 1]
    assert counts.observe(prompt(0, 8) + [9, 9, 9, 9], 3) == [2, 2, 1]
    assert counts.observe(prompt(1, 12), 3) == [1, 1, 1]  # another first chunk: another chain
    assert len(counts._counts) <= 4


def test_on_stored_reports_tokens_and_lag_and_metrics_render_them():
    cache = GatedCache()
    cache.gate.set()
    metrics = EngineMetrics()
    storer = KVStorer(cache, StorePolicy(), CT)
    storer.on_stored = lambda tokens, lag: (metrics.stored_tokens.inc(tokens), metrics.store_lag.observe(lag))
    metrics.store_backlog.set_function(lambda: storer.backlog)
    storer.submit(prompt(0, 8), cache_of(8)).result()
    storer.flush()
    text = metrics.render().decode()
    assert "kvcodec_stored_tokens_total 8.0" in text and "kvcodec_store_lag_seconds_count 1.0" in text
    assert "kvcodec_store_backlog 0.0" in text
    storer.shutdown()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_min_seen_is_validated(bad):
    with pytest.raises(ConfigError):
        StorePolicy(min_seen=bad)


def test_gather_kv_is_cache_to_tensor_of_the_first_tokens():
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(3, 2, 20, 2, 8, generator=g).half()
    layers = [(kv[i, 0].permute(1, 0, 2)[None], kv[i, 1].permute(1, 0, 2)[None]) for i in range(3)]  # strided
    for n in (20, 12, 1):
        want = cache_to_tensor([(k[:, :, :n], v[:, :, :n]) for k, v in layers])
        got = gather_kv(layers, n)
        assert got.is_contiguous() and got.dtype == want.dtype and torch.equal(got, want)
    ragged = [layers[0], (layers[1][0][:, :, :10], layers[1][1])]
    with pytest.raises(ShapeError, match="layer 1"):  # cache_to_tensor's error
        gather_kv(ragged, 20)


def test_a_failed_store_frees_its_kv_without_the_collector(tmp_path):
    """A store that fails for real (its directory turned into a file) fails the job's Future, and neither the
    job's KV nor its Future is left in a reference cycle (the error's frames held both: on CUDA the KV stayed
    on the GPU until the collector's next full pass)."""
    from test_fetcher_codecs import cyclic_buffers

    cache = PrefixCache(open_store(f"file://{tmp_path}/store"), "m", make_codec("raw", chunk_tokens=CT), "cpu")
    shutil.rmtree(tmp_path / "store")
    (tmp_path / "store").write_bytes(b"")  # every put fails now: the store's folder is a file
    failed = []

    def stores() -> None:
        storer = KVStorer(cache, StorePolicy(), CT, max_pending=3)
        future = storer.submit(prompt(0, 16), cache_of(16))
        failed.append(str(future.exception(30)))  # not the error itself: it would keep its frames alive
        storer.shutdown()  # its thread done with the job

    assert cyclic_buffers(stores) == []
    assert "failed" in failed[0]
