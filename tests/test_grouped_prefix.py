"""GroupedPrefixCache: store, look up and fetch prefixes of multi-group KV through a real store."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcodec.codecs import make_codec
from kvcodec.codecs.grouped import GroupedCodec
from kvcodec.codecs.raw import RawCodec
from kvcodec.errors import ShapeError
from kvcodec.fetcher.grouped import GroupedPrefixCache
from kvcodec.fetcher.keys import blob_key, meta_key
from kvcodec.kvspec import GroupedKV, KVSpec, LayerSpec
from kvcodec.store import open_store
from test_fetcher import SlowStore

SPEC = KVSpec(
    (
        LayerSpec("sliding", (2, 8), (2, 8), keep=5),
        LayerSpec("mla", (1, 16), (1, 8)),
        LayerSpec("full", (2, 8), (2, 8)),
    ),
    "float16",
)
CT = 8


def _kv(stop: int) -> GroupedKV:
    torch.manual_seed(stop)
    kv = GroupedKV.empty(SPEC, stop, window=False)
    for t in kv.tensors:
        t.copy_(torch.randn(t.shape))
    return kv


@pytest.fixture
def cache():
    return GroupedPrefixCache(open_store("memory://"), "test-model", make_codec("raw", chunk_tokens=CT), spec=SPEC)


def test_put_lookup_fetch_shorter_prefix(cache):
    ids = list(range(100, 130))
    kv = _kv(30)
    assert cache.put(ids, kv) == 4
    assert cache.put(ids, kv) == 0  # idempotent
    other = ids[:16] + [7] * 10  # shares two chunks
    assert cache.lookup(other) == 16
    res = cache.fetch(other, 16, out=cache.target(16))
    assert res.ok and res.tokens_restored == 16 and res.stats.chunks_restored == 2
    assert res.kv.equal(kv.view(0, 16))
    assert res.kv.prefix(16).equal(kv.prefix(16))


def test_only_complete_chunks_are_stored(cache):
    ids = list(range(33))
    windowed = _kv(33).prefix(33)  # the sliding group holds positions 28..32 only
    assert windowed.starts == (28, 0, 0, 0)
    assert cache.put(ids, windowed) == 1  # chunk 4 (32) is the only one all groups hold whole
    assert cache.lookup(ids) == 0 and cache.store.exists(meta_key(cache.keys(ids)[4]))


def test_damaged_chunk_is_dropped_and_the_fetch_stops(cache):
    ids = list(range(24))
    cache.put(ids, _kv(24))
    k1 = cache.keys(ids)[1]
    blob = bytearray(cache.store.get(blob_key(k1, 0)))
    blob[-2] ^= 1
    cache.store.put(blob_key(k1, 0), bytes(blob))
    res = cache.fetch(ids, 24)
    assert res.tokens_restored == 8 and res.error is not None and res.stats.chunks_dropped == 1
    assert not cache.store.exists(meta_key(k1))
    assert cache.lookup(ids) == 8


def test_wrong_inputs_are_errors(cache):
    with pytest.raises(ShapeError):
        cache.put(list(range(8)), torch.zeros(1, 2, 8, 1, 4))
    with pytest.raises(ShapeError):
        cache.put(list(range(4)), _kv(8))
    with pytest.raises(ShapeError):
        cache.fetch(list(range(8)), 8, out=GroupedKV.empty(SPEC, 8))  # windowed: lacks sliding history


def _slow_cache(delay_s: float, **options) -> GroupedPrefixCache:
    store = SlowStore(open_store("memory://"), delay_s)  # a slow link; .stalls holds gets till .release
    return GroupedPrefixCache(store, "test-model", make_codec("raw", chunk_tokens=CT), spec=SPEC, **options)


def test_fetch_is_pipelined_and_restores_a_target_shorter_than_the_last_chunk():
    cache = _slow_cache(0.05, net_workers=2, max_inflight=4, decode_workers=2)
    ids = list(range(200, 232))
    kv = _kv(32)
    assert cache.put(ids, kv) == 4
    res = cache.fetch(ids, 28)  # the last chunk reaches past the 28-token target
    assert res.ok and res.tokens_restored == 28 and res.stats.chunks_restored == 4, res.error
    assert res.kv.stop == 28 and res.kv.equal(kv.view(0, 28))
    assert res.stats.peak_inflight >= 2  # two gets in flight at once: not one chunk after the other
    spans = sorted((t.net_start, t.net_end) for t in res.stats.timeline)
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:])), spans


def test_fetch_stops_at_the_deadline_with_what_was_restored():
    import time

    cache = _slow_cache(0.0)
    ids = list(range(40))
    kv = _kv(40)
    cache.put(ids, kv)
    cache.store.stalls = lambda key: True  # every get now waits far longer than the whole budget (60 s)
    try:
        t0 = time.monotonic()
        res = cache.fetch(ids, 40, deadline_s=0.25)
        took = time.monotonic() - t0
    finally:
        cache.store.release.set()
    assert took < 30  # the fetch did not wait for the stalled gets (60 s)
    assert not res.ok and res.tokens_restored == 0 and "deadline" in str(res.error)
    assert res.stats.chunks_dropped == 0 and cache.lookup(ids) == 40  # a slow link is no damage


def test_kv_stored_in_another_dtype_restores_into_the_models(cache):
    """An engine whose StorePolicy stores float16 KV of a float32 model (the demo on CPU does): the
    put was refused ("expected a GroupedKV of this model's KVSpec") and nothing was ever stored."""
    wide = dataclasses.replace(SPEC, dtype="float32")
    cache32 = GroupedPrefixCache(cache.store, "test-model", make_codec("raw", chunk_tokens=CT), spec=wide)
    ids, kv = list(range(16)), _kv(16)  # float16 values
    assert cache32.put(ids, kv) == 2
    res = cache32.fetch(ids, 16)
    assert res.ok and res.kv.spec == wide and res.kv.equal(kv.to(dtype=torch.float32))
    huge = GroupedKV(wide, 16, res.kv.starts, tuple(torch.full_like(t, 1e6) for t in res.kv.tensors))
    other = list(range(50, 66))
    assert cache.put(other, huge) == 2  # float32 values beyond float16's range: not restored as inf
    bad = cache.fetch(other, 16)
    assert bad.tokens_restored == 0 and "beyond the range" in str(bad.error)


class _StagedRaw(RawCodec):
    """The raw codec in two halves (StagedDecode): stage checks the blob, finish decodes it."""

    def stage(self, blob, out):
        self.inspect_chunk(blob)
        return bytes(blob)

    def finish(self, staged, outs):
        for blob, out in zip(staged, outs):
            self.decode_chunk(blob, out)


@pytest.mark.parametrize("batched", [False, True], ids=["unstaged", "staged"])
def test_a_staged_grouped_fetch_restores_what_the_unstaged_one_does_up_to_a_chunk_too_wide_for_the_target(batched):
    """bfloat16 chunks into a float16 target (every group restored whole and narrowed, in the decode worker):
    a value beyond float16 in chunk 2 stops the fetch there with a ShapeError, chunks 0-1 restored, staged or
    not; a fetch past the last whole chunk's end restores the rest (the last chunk decoded whole, copied)."""
    codec = GroupedCodec(_StagedRaw(chunk_tokens=CT))
    assert codec.stages and not GroupedCodec(make_codec("raw", chunk_tokens=CT)).stages
    store, ids = open_store("memory://"), list(range(100, 140))
    kv = GroupedKV.empty(dataclasses.replace(SPEC, dtype="bfloat16"), 40, window=False)
    for t in kv.tensors:
        t.copy_(torch.randn(t.shape))
    GroupedPrefixCache(store, "m", codec, spec=SPEC, batched_restore=False).put(ids, kv)
    fetch = GroupedPrefixCache(store, "m", codec, spec=SPEC, batched_restore=batched)
    r = fetch.fetch(ids, 37)
    assert r.ok and r.tokens_restored == 37
    assert all(torch.equal(a, b.half()) for a, b in zip(r.kv.tensors, kv.view(0, 37).tensors))
    kv.tensors[2][0, 0, 20] = 1e6  # chunk 2 (tokens 16..23) of the full group: beyond float16
    other = list(range(200, 240))
    GroupedPrefixCache(store, "m", codec, spec=SPEC, batched_restore=False).put(other, kv)
    r = fetch.fetch(other, 40)
    assert isinstance(r.error, ShapeError) and r.tokens_restored == 16
