"""Damaged stores heal in one round (issue 22): a fetch that finds damaged chunks drops them all
(the damaged chunk and every planned chunk behind it), so one put rewrites the prefix; a put
rewrites chunks whose meta survived but whose blobs did not; a store opens by a deadline."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from kvcodec.codecs import make_codec
from kvcodec.errors import StoreError
from kvcodec.fetcher import PrefixCache, blob_key
from kvcodec.fetcher.profile import DecodeProfile
from kvcodec.store import open_store

CHUNK = 16


def _cache():
    codec = make_codec("raw", chunk_tokens=CHUNK)
    return PrefixCache(
        open_store("memory://"), "model-a", codec, "cpu", profile=DecodeProfile.default(codec.resolutions)
    )


def _kv(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    return torch.randn((2, 2, tokens, 2, 8), generator=g).half(), torch.arange(tokens) + 100


def _damage(cache, key: str) -> None:
    for j in range(len(cache.codec.resolutions)):
        blob = bytearray(cache.store.get(blob_key(key, j)))
        blob[len(blob) // 2] ^= 0x10
        cache.store.put(blob_key(key, j), bytes(blob))


def test_two_damaged_chunks_heal_with_one_fetch_and_one_put():
    cache = _cache()
    kv, ids = _kv(5 * CHUNK)
    cache.put(ids, kv)
    keys = cache.keys(ids)
    _damage(cache, keys[1])
    _damage(cache, keys[3])
    r = cache.fetch(ids)
    assert r.tokens_restored == CHUNK and r.error is not None
    assert torch.equal(r.kv[:, :, :CHUNK], kv[:, :, :CHUNK])
    assert cache.lookup(ids) == CHUNK
    assert cache.put(ids, kv) == 2  # both damaged chunks, in one put
    healed = cache.fetch(ids)
    assert healed.error is None and torch.equal(healed.kv, kv)


def test_a_put_before_any_fetch_rewrites_a_chunk_whose_blob_is_gone():
    cache = _cache()
    kv, ids = _kv(3 * CHUNK)
    cache.put(ids, kv)
    keys = cache.keys(ids)
    cache.store.delete(blob_key(keys[1], 0))
    assert cache.put(ids, kv) == 1
    assert cache.put(ids, kv) == 0  # idempotent again once whole
    r = cache.fetch(ids)
    assert r.error is None and torch.equal(r.kv, kv)


def test_store_opens_by_its_deadline_on_a_paused_redis(redis_server):
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        t = time.monotonic()
        with pytest.raises(StoreError, match="deadline"):
            open_store(redis_server.url, deadline_s=0.3, socket_timeout=30.0, socket_connect_timeout=30.0)
        assert time.monotonic() - t < 15  # at the deadline, not the 30 s socket timeout
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    st = open_store(redis_server.url, deadline_s=2.0)
    st.put("k", b"v")
    assert st.get("k") == b"v"
