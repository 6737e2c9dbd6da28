"""PrefixCache over a REAL redis-server: round trip, persistence across restart, server death."""

from __future__ import annotations

import itertools
import signal
import time

import pytest
import torch

from kvbench.net.redis_server import redis_server_binary
from kvcodec.config import CodecConfig
from kvcodec.errors import FetchError, StoreError
from kvcodec.fetcher import DecodeProfile, PrefixCache
from kvcodec.fetcher.rawcodec import RawCodec
from kvcodec.store import open_store
from test_fetcher import SlowCodec

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(
        redis_server_binary() is None, reason="redis-server binary not installed (apt-get install redis-server)"
    ),
]

CFG = CodecConfig(chunk_tokens=32, resolutions=((256, 256), (512, 512)), search_layout=False)


def kv_and_ids(tokens=256):
    g = torch.Generator().manual_seed(0)
    return torch.randn((2, 2, tokens, 2, 64), generator=g).half(), list(range(7, 7 + tokens))


def cache_on(url, socket_timeout=1.0, **kw):
    return PrefixCache(
        open_store(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout, retries=0),
        "m",
        CFG,
        "cpu",
        codec=RawCodec(("raw", "lz4")),
        profile=DecodeProfile.default(CFG.resolutions),
        **kw,
    )


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


def test_keys_of_another_type_are_no_objects_so_the_next_put_rewrites_them(redis_server):
    """A list where a blob was and a hash where a meta was: GET raised WRONGTYPE on every fetch and
    EXISTS said the chunk was stored, so no put ever rewrote it (that prefix lost its reuse for good)."""
    import redis

    from kvcodec.fetcher import blob_key, meta_key

    kv, ids = kv_and_ids()
    c = cache_on(redis_server.url)
    c.put(ids, kv)
    raw, ns, keys = redis.Redis.from_url(redis_server.url), c.store.namespace, c.keys(ids)
    for key, write in (
        (blob_key(keys[1], 0), lambda k: raw.rpush(k, b"x")),
        (meta_key(keys[3]), lambda k: raw.hset(k, "a", "b")),
    ):
        raw.delete(ns + key)
        write(ns + key)
    assert c.lookup(ids) == 96  # chunk 3: its meta is a hash, no object
    r = c.fetch(ids, 256)
    assert r.tokens_restored == 32 and r.error is not None and "WRONGTYPE" not in str(r.error)
    assert c.put(ids, kv) >= 1
    r = c.fetch(ids, 256)
    assert r.ok and torch.equal(r.kv, kv)


def test_server_killed_mid_fetch_gives_partial_result_not_hang(redis_server):
    kv, ids = kv_and_ids(512)
    c = cache_on(redis_server.url, max_inflight=1)
    c.put(ids, kv)
    decodes = itertools.count(1)

    def kill_before_the_third_decode(_blob):
        if next(decodes) == 3:  # mid-fetch, whatever the machine's speed: chunks 0 and 1 are restored
            redis_server.kill()

    c.codec = SlowCodec(c.codec, 0.0, before=kill_before_the_third_decode)
    t = time.monotonic()
    r = c.fetch(ids, 512)
    assert time.monotonic() - t < 30  # no hang: the dead server's gets fail at once (1 s timeouts, no retry)
    assert isinstance(r.error, StoreError)
    assert 0 < r.tokens_restored < 512
    assert torch.equal(r.kv[:, :, : r.tokens_restored], kv[:, :, : r.tokens_restored])


def test_paused_server_is_bounded_by_the_deadline(redis_server):
    """SIGSTOP: the server holds every call until the client's socket timeout (here 30 s); the
    fetch and the lookup still return at their deadline."""
    kv, ids = kv_and_ids()
    c = cache_on(redis_server.url, socket_timeout=30.0)
    c.put(ids, kv)
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        t = time.monotonic()
        r = c.fetch(ids, 256, deadline_s=0.3)
        took = time.monotonic() - t
        assert isinstance(r.error, FetchError) and "deadline" in str(r.error) and took < 15, (took, r.error)
        t = time.monotonic()
        with pytest.raises(FetchError):
            c.lookup(ids, deadline_s=0.3)
        assert time.monotonic() - t < 15
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert c.fetch(ids, 256).ok  # the server answers again: so does the cache


def test_lookup_on_dead_server_raises(redis_server):
    c = cache_on(redis_server.url)
    redis_server.kill()
    with pytest.raises(StoreError):
        c.lookup(list(range(64)))
