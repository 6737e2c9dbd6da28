"""PrefixCache over a REAL redis-server: round trip, persistence across restart, server death."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvcodec.config import CodecConfig
from kvcodec.errors import StoreError
from kvcodec.fetcher import DecodeProfile, PrefixCache
from kvcodec.fetcher.rawcodec import RawCodec
from kvbench.net.redis_server import redis_server_binary
from kvcodec.store import open_store

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(redis_server_binary() is None,
                       reason="redis-server binary not installed (apt-get install redis-server)"),
]

CFG = CodecConfig(chunk_tokens=32, resolutions=((256, 256), (512, 512)), search_layout=False)


def kv_and_ids(tokens=256):
    g = torch.Generator().manual_seed(0)
    return torch.randn((2, 2, tokens, 2, 64), generator=g).half(), list(range(7, 7 + tokens))


def cache_on(url, **kw):
    return PrefixCache(open_store(url, socket_timeout=1.0, socket_connect_timeout=1.0, retries=0),
                       "m", CFG, "cpu", codec=RawCodec(("raw", "lz4")),
                       profile=DecodeProfile.default(CFG.resolutions), **kw)


def test_roundtrip_and_restart(redis_server):
    kv, ids = kv_and_ids()
    c = cache_on(redis_server.url)
    assert c.put(ids, kv) == 8
    r = c.fetch(ids, 256)
    assert r.ok and torch.equal(r.kv, kv)
    redis_server.stop()
    redis_server.start()
    c2 = cache_on(redis_server.url)
    assert c2.lookup(ids) == 256
    assert c2.put(ids, kv) == 0
    assert torch.equal(c2.fetch(ids, 256).kv, kv)


def test_server_killed_mid_fetch_gives_partial_result_not_hang(redis_server):
    kv, ids = kv_and_ids(512)
    c = cache_on(redis_server.url, max_inflight=1)
    c.put(ids, kv)
    inner = c.codec.decode_chunk_blob
    started = threading.Event()

    def slow(blob, device="cpu", out=None):  # slow decode so the kill lands mid-fetch
        started.set()
        time.sleep(0.05)
        return inner(blob, device=device, out=out)

    c.codec.decode_chunk_blob = slow
    killer = threading.Thread(target=lambda: (started.wait(5), time.sleep(0.12), redis_server.kill()))
    killer.start()
    t = time.monotonic()
    r = c.fetch(ids, 512)
    killer.join()
    assert time.monotonic() - t < 6.0
    assert isinstance(r.error, StoreError)
    assert 0 < r.tokens_restored < 512
    assert torch.equal(r.kv[:, :, : r.tokens_restored], kv[:, :, : r.tokens_restored])


def test_lookup_on_dead_server_raises(redis_server):
    c = cache_on(redis_server.url)
    redis_server.kill()
    with pytest.raises(StoreError):
        c.lookup(list(range(64)))
