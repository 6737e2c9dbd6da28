"""PrefixCache: keys, put/lookup idempotence, fetch pipeline, fallbacks, resolution policies."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.codecs.hevc.codec import HevcCodec
from kvcodec.codecs.raw import RawCodec
from kvcodec.config import CodecConfig
from kvcodec.errors import ChecksumError, ConfigError, FetchError, FormatError, ShapeError, StoreError
from kvcodec.fetcher import (
    AdaptivePolicy,
    BandwidthEstimator,
    ChoiceContext,
    DecodeProfile,
    MinBytesPolicy,
    MinDecodePolicy,
    PrefixCache,
    blob_key,
    chunk_keys,
    get_policy,
    meta_key,
    predicted_finish,
)
from kvcodec.fetcher.profile import load_or_calibrate
from kvcodec.restore.paged import PagedKV
from kvcodec.store import open_store

CFG = CodecConfig(chunk_tokens=16, resolutions=((256, 256), (512, 512)), search_layout=False)


def make_kv(tokens=100, layers=3, heads=2, dim=32, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((layers, 2, tokens, heads, dim), generator=g).to(dtype)


def ids_for(n, offset=1000):
    return list(range(offset, offset + n))


RAW = RawCodec(("raw", "zstd"), chunk_tokens=CFG.chunk_tokens, resolutions=CFG.resolutions)


@pytest.fixture
def raw_cache():
    return PrefixCache(open_store("memory://"), "model-a", RAW, "cpu", profile=DecodeProfile.default(CFG.resolutions))


class SlowCodec:
    """A real codec whose decodes take `delay` seconds; `before(blob)` runs before each."""

    def __init__(self, inner, delay, before=None):
        self.inner, self.delay, self.before = inner, delay, before
        self.id, self.chunk_tokens, self.resolutions = inner.id, inner.chunk_tokens, inner.resolutions

    def encode_chunks(self, kv, **kw):
        return self.inner.encode_chunks(kv, **kw)

    def inspect_chunk(self, blob):
        return self.inner.inspect_chunk(blob)

    def decode_chunk(self, blob, out):
        if self.before:
            self.before(blob)
        time.sleep(self.delay)
        return self.inner.decode_chunk(blob, out)


# ------------------------------------------------------------------------------------- keys


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=80), st.integers(0, 80))
def test_keys_of_a_prefix_are_a_prefix_of_keys(tokens, cut):
    cut = min(cut, len(tokens))
    full = chunk_keys(tokens, "m", CFG, partial=False)
    pre = chunk_keys(tokens[:cut], "m", CFG, partial=False)
    assert full[: len(pre)] == pre
    assert len(full) == len(tokens) // CFG.chunk_tokens
    assert len(chunk_keys(tokens, "m", CFG)) == -(-len(tokens) // CFG.chunk_tokens)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 50000), min_size=16, max_size=48), st.integers(0, 15))
def test_keys_depend_on_every_token_model_and_config(tokens, pos):
    base = chunk_keys(tokens, "m", CFG)
    changed = list(tokens)
    changed[pos] += 1
    k2 = chunk_keys(changed, "m", CFG)
    assert all(a != b for a, b in zip(base, k2))  # chaining: a change in chunk 0 changes all
    assert chunk_keys(tokens, "other-model", CFG)[0] != base[0]
    assert chunk_keys(tokens, "m", CodecConfig(chunk_tokens=16, resolutions=((256, 256),)))[0] != base[0]
    assert len(base[0]) == 64 and int(base[0], 16) >= 0


def test_keys_accept_tensors_and_arrays():
    t = torch.arange(40)
    assert chunk_keys(t, "m", CFG) == chunk_keys(list(range(40)), "m", CFG)
    assert chunk_keys(t[None], "m", CFG) == chunk_keys(t.numpy(), "m", CFG)
    with pytest.raises(ShapeError):
        chunk_keys(torch.zeros(2, 3, dtype=torch.long), "m", CFG)


# ------------------------------------------------------------------------------- put / lookup


def test_put_lookup_idempotent(raw_cache):
    kv, ids = make_kv(100), ids_for(100)
    assert raw_cache.lookup(ids) == 0
    assert raw_cache.put(ids, kv) == 7  # 6 full chunks + a 4-token tail
    assert raw_cache.put(ids, kv) == 0
    assert raw_cache.lookup(ids) == 100
    assert raw_cache.lookup(ids[:50]) == 48  # 3 whole chunks; the 2-token tail is not stored
    assert raw_cache.lookup(ids + [7, 8, 9]) == 96  # the stored tail was 4 tokens, not these
    assert raw_cache.lookup([1] + ids) == 0
    # extending the prefix writes only the new chunks
    kv2, ids2 = make_kv(130, seed=1), ids_for(130)
    kv2[:, :, :96] = kv[:, :, :96]
    assert raw_cache.put(ids2, kv2) == 3  # chunk 6 (full now), 7, and the 2-token tail
    assert raw_cache.lookup(ids2) == 130


def test_store_url_accepted(tmp_path):
    c = PrefixCache(f"file://{tmp_path}", "m", RawCodec(chunk_tokens=16), "cpu")
    kv, ids = make_kv(20), ids_for(20)
    assert c.put(ids, kv) == 2 and c.lookup(ids) == 20
    assert torch.equal(c.fetch(ids).kv, kv)


def test_lookup_uses_one_batched_query(raw_cache):
    kv, ids = make_kv(64), ids_for(64)
    raw_cache.put(ids, kv)
    calls = []
    orig = raw_cache.store.exists_many
    raw_cache.store.exists_many = lambda keys: calls.append(len(keys)) or orig(keys)
    assert raw_cache.lookup(ids + ids_for(64, 5000)) == 64
    assert calls == [8]


def test_lookup_whole_reads_every_blob_size_in_one_batched_query_and_stops_at_a_cut_blob(raw_cache):
    kv, ids = make_kv(64), ids_for(64)
    raw_cache.put(ids, kv)
    st, sizes = raw_cache.store, []
    many = st.size_many
    st.size_many = lambda keys: sizes.append(len(keys)) or many(keys)
    assert raw_cache.lookup(ids, whole=True) == 64
    assert sizes == [4 * len(RAW.resolutions)]  # 4 chunks' blobs, one query
    keys = raw_cache.keys(ids)
    cut = blob_key(keys[1], 0)
    st.put(cut, st.get(cut)[:-1])
    st.put(meta_key(keys[3]), b"{not a meta")  # a later damaged chunk: dropped once reached, not before
    assert raw_cache.lookup(ids, whole=True) == 16 and len(sizes) == 2
    assert st.get(meta_key(keys[1])) is None and st.get(meta_key(keys[3])) == b"{not a meta"
    assert raw_cache.lookup(ids, whole=True) == 16 and raw_cache.put(ids, kv) == 1  # chunk 1 rewritten
    assert raw_cache.lookup(ids, whole=True) == 48 and st.get(meta_key(keys[3])) is None


def test_meta_is_commit_marker(raw_cache):
    kv, ids = make_kv(32), ids_for(32)
    raw_cache.put(ids, kv)
    k = raw_cache.keys(ids)
    raw_cache.store.delete(meta_key(k[1]))  # as if the writer died before committing chunk 1
    assert raw_cache.lookup(ids) == 16
    assert raw_cache.put(ids, kv) == 1


def test_put_rejects_bad_shapes(raw_cache):
    with pytest.raises(ShapeError):
        raw_cache.put(ids_for(10), torch.zeros(2, 3, 10, 2, 4))
    with pytest.raises(ShapeError):
        raw_cache.put(ids_for(5), make_kv(10))


# ------------------------------------------------------------------------------------ fetch


def test_fetch_roundtrip_raw_bit_exact(raw_cache):
    kv, ids = make_kv(100), ids_for(100)
    raw_cache.put(ids, kv)
    for pol in ("adaptive", "fixed:0", "fixed:512x512", "min-bytes", "min-decode"):
        r = raw_cache.fetch(ids, 100, policy=pol)
        assert r.ok and r.tokens_restored == 100, (pol, r.error)
        assert torch.equal(r.kv, kv)
        assert sum(r.stats.resolution_counts.values()) == 7
        assert [t.index for t in r.timeline] == list(range(7))
        for t in r.timeline:
            assert t.net_start <= t.net_end <= t.dec_start <= t.dec_end <= t.restore_start <= t.restore_end


def test_fetch_partial_and_into_preallocated_out(raw_cache):
    kv, ids = make_kv(100), ids_for(100)
    raw_cache.put(ids, kv)
    out = torch.full((3, 2, 120, 2, 32), 7.0, dtype=torch.float32)
    r = raw_cache.fetch(ids, 40, out=out)
    assert r.ok and r.tokens_restored == 40 and r.kv is out
    assert torch.equal(out[:, :, :40], kv[:, :, :40].float())
    assert (out[:, :, 40:] == 7).all()  # nothing beyond what was asked
    with pytest.raises(ShapeError):
        raw_cache.fetch(ids, 40, out=torch.zeros(3, 2, 20, 2, 32))


def test_an_integer_out_is_refused_not_filled_with_truncated_kv(raw_cache):
    kv, ids = make_kv(48), ids_for(48)
    raw_cache.put(ids, kv)
    out = torch.zeros((3, 2, 48, 2, 32), dtype=torch.int32)
    with pytest.raises(ShapeError, match="int32"):
        raw_cache.fetch(ids, out=out)
    assert not out.any()


def test_bfloat16_chunks_beyond_float16s_range_stop_the_fetch_instead_of_turning_to_inf(raw_cache):
    ct = CFG.chunk_tokens
    kv, ids = make_kv(3 * ct, dtype=torch.bfloat16), ids_for(3 * ct)
    kv[1, 0, ct + 5, 0, 3] = 1e6  # in chunk 1: beyond float16's 65504
    raw_cache.put(ids, kv)
    out = torch.zeros((3, 2, 3 * ct, 2, 32), dtype=torch.float16)
    r = raw_cache.fetch(ids, out=out)
    assert not r.ok and isinstance(r.error, ShapeError) and "float16" in str(r.error)
    assert r.tokens_restored == ct and torch.equal(out[:, :, :ct], kv[:, :, :ct].half())
    assert not out[:, :, ct:].any() and r.stats.chunks_restored == 1  # nothing of chunk 1 written or counted
    assert r.stats.chunks_staged == 1  # nor counted as staged
    pages = torch.zeros((3, 2, 6, ct // 2, 2, 32), dtype=torch.float16)  # paged targets convert the same way
    paged = raw_cache.fetch(ids, out=PagedKV(pages, torch.tensor([5, 0, 3, 1, 4, 2])))
    assert isinstance(paged.error, ShapeError) and paged.tokens_restored == ct and pages.isfinite().all()
    again = raw_cache.fetch(ids)  # the chunks were sound: none was dropped
    assert again.ok and again.stats.chunks_dropped == 0 and torch.equal(again.kv, kv)


def test_bfloat16_chunks_within_float16s_range_restore_into_float16(raw_cache):
    kv, ids = make_kv(2 * CFG.chunk_tokens, dtype=torch.bfloat16), ids_for(2 * CFG.chunk_tokens)
    raw_cache.put(ids, kv)
    out = torch.zeros(kv.shape, dtype=torch.float16)
    r = raw_cache.fetch(ids, out=out)
    assert r.ok and torch.equal(out, kv.half()) and r.stats.chunks_staged == 2


def test_a_deadline_that_is_not_a_number_is_refused_and_a_device_is_checked(raw_cache):
    # NaN never passed: the fetch reported "no answer within the deadline of nans"
    for bad in (float("nan"), "5", True):
        with pytest.raises(ConfigError, match="deadline"):
            raw_cache.fetch(ids_for(16), deadline_s=bad)
    with pytest.raises(ConfigError, match="device must be cpu or a CUDA device"):
        PrefixCache(open_store("memory://"), "m", RAW, "bogus")


def test_metas_that_claim_a_huge_shape_are_dropped_before_anything_is_sized_from_them(raw_cache):
    """Every meta of a prefix rewritten to a shape of terabytes: the fetch returns the error
    (it never raises nor allocates), drops the chunks, and the next put stores them again."""
    kv, ids = make_kv(100), ids_for(100)
    raw_cache.put(ids, kv)
    for k in raw_cache.keys(ids):
        meta = raw_cache.store.get(meta_key(k))
        raw_cache.store.put(meta_key(k), meta.replace(b'"shape":[3,2,32]', b'"shape":[4000,3000,640]'))
    r = raw_cache.fetch(ids)
    assert r.tokens_restored == 0 and isinstance(r.error, FormatError) and "meta says" in str(r.error)
    assert r.stats.chunks_dropped == len(raw_cache.keys(ids))
    raw_cache.put(ids, kv)
    assert torch.equal(raw_cache.fetch(ids).kv, kv)


def test_a_cache_on_a_store_that_refuses_writes_leaves_damaged_chunks_in_place():
    """drop_damaged=False (serve on a store that refuses writes): the damaged metas stay, no delete
    is tried (each would fail, and nothing would rewrite them), the fetch still reports the damage."""
    cache = PrefixCache(open_store("memory://"), "model-a", RAW, "cpu", drop_damaged=False)
    kv, ids = make_kv(100), ids_for(100)
    cache.put(ids, kv)
    damaged = {}
    for k in cache.keys(ids):
        damaged[k] = cache.store.get(meta_key(k)).replace(b'"shape":[3,2,32]', b'"shape":[4000,3000,640]')
        cache.store.put(meta_key(k), damaged[k])
    r = cache.fetch(ids)
    assert r.tokens_restored == 0 and isinstance(r.error, FormatError) and r.stats.chunks_dropped == 0
    assert all(cache.store.get(meta_key(k)) == m for k, m in damaged.items())


def test_a_meta_whose_shape_the_target_and_blob_disagree_with_is_dropped_and_healed(raw_cache):
    """Chunk 0's meta rewritten to another shape: an engine's target (its model's shape) refused it
    on every request and nothing was dropped, so that prefix was never stored again. A target that
    fits neither the meta nor the blob (the caller's mistake) drops nothing."""
    kv, ids = make_kv(48), ids_for(48)
    raw_cache.put(ids, kv)
    k0 = meta_key(raw_cache.keys(ids)[0])
    raw_cache.store.put(k0, raw_cache.store.get(k0).replace(b'"shape":[3,2,32]', b'"shape":[3,2,16]'))
    wrong = raw_cache.fetch(ids, out=torch.zeros((3, 2, 48, 4, 8), dtype=torch.float16))
    assert wrong.tokens_restored == 0 and wrong.stats.chunks_dropped == 0
    r = raw_cache.fetch(ids, out=torch.zeros_like(kv))
    assert r.tokens_restored == 0 and isinstance(r.error, ShapeError) and r.stats.chunks_dropped == 1
    assert raw_cache.put(ids, kv) == 1
    assert torch.equal(raw_cache.fetch(ids, out=torch.zeros_like(kv)).kv, kv)


def test_fetch_beyond_stored_reports_error(raw_cache):
    kv, ids = make_kv(48), ids_for(48)
    raw_cache.put(ids, kv)
    longer = ids + ids_for(40, 9000)
    r = raw_cache.fetch(longer, 88)
    assert r.tokens_restored == 48 and isinstance(r.error, FetchError)
    assert torch.equal(r.kv[:, :, :48], kv)
    r = raw_cache.fetch(ids_for(30, 5), 30)
    assert r.tokens_restored == 0 and isinstance(r.error, FetchError) and r.kv is None


def test_fetch_real_codec_roundtrip():
    cache = PrefixCache(open_store("memory://"), "m", CFG, "cpu", profile=DecodeProfile.default(CFG.resolutions))
    kv, ids = make_kv(40, layers=2), ids_for(40)
    assert cache.put(ids, kv) == 3
    r = cache.fetch(ids, 40, policy="fixed:1")
    assert r.ok and r.tokens_restored == 40
    # int8 min-max quantization: error at most half a step of each channel's range
    rng = kv.float().amax(2, keepdim=True) - kv.float().amin(2, keepdim=True)
    assert ((r.kv.float() - kv.float()).abs() <= rng / 255 * 0.5 + 1e-2).all()
    r0 = cache.fetch(ids, 40, policy="fixed:0")
    assert torch.equal(r0.kv, r.kv)  # both resolutions decode to the same values


def test_fetch_of_split_chunks_restores_what_one_stream_does():
    """Chunks stored as several streams (a layer range each) fetch into the same values, under
    their own codec id, and a damaged part stops the fetch at that chunk."""
    kv, ids = make_kv(40, layers=3), ids_for(40)
    coded = CodecConfig(**{**CFG.to_dict(), "plain_fallback": False})  # both int8 whatever the sizes
    one = PrefixCache(open_store("memory://"), "m", coded, "cpu", profile=DecodeProfile.default(CFG.resolutions))
    split_cfg = CodecConfig(**{**coded.to_dict(), "streams_per_chunk": 2})
    store = open_store("memory://")
    cache = PrefixCache(store, "m", split_cfg, "cpu", profile=DecodeProfile.default(CFG.resolutions))
    assert one.put(ids, kv) == 3 and cache.put(ids, kv) == 3
    assert cache.codec_id != one.codec_id
    want = one.fetch(ids, 40, policy="fixed:0").kv
    got = cache.fetch(ids, 40, policy="fixed:0")
    assert got.ok and torch.equal(got.kv, want)
    key = blob_key(cache.keys(ids)[1], 0)
    blob = bytearray(store.get(key))
    blob[-10] ^= 0xFF  # inside the last part's video stream
    store.put(key, bytes(blob))
    r = cache.fetch(ids, 40, policy="fixed:0")
    assert r.tokens_restored == 16 and isinstance(r.error, ChecksumError)


def test_corrupt_chunk_stops_with_prefix(raw_cache):
    kv, ids = make_kv(100), ids_for(100)
    raw_cache.put(ids, kv)
    k = raw_cache.keys(ids)
    for j in range(2):
        blob = bytearray(raw_cache.store.get(blob_key(k[3], j)))
        blob[-5] ^= 0xFF  # flip bits in the payload
        raw_cache.store.put(blob_key(k[3], j), bytes(blob))
    r = raw_cache.fetch(ids, 100)
    assert isinstance(r.error, ChecksumError)
    assert r.tokens_restored == 48
    assert torch.equal(r.kv[:, :, :48], kv[:, :, :48])


class DropsTheCheck:
    """A store whose connection drops on the check of the chunks behind a damaged one (a fault
    that cannot be timed for real between the fetch and its check)."""

    def __init__(self, inner, key):
        self.inner, self.key, self.url = inner, key, inner.url

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get_many(self, keys):
        if len(keys) > 1 and all(k.startswith(self.key) for k in keys):
            raise StoreError(f"{self.url}: connection reset (test)")
        return self.inner.get_many(keys)


def test_a_store_failure_while_checking_the_chunks_behind_a_damaged_one_drops_none_of_them():
    inner = open_store("memory://")
    kv, ids = make_kv(64), ids_for(64)
    cache = PrefixCache(inner, "model-a", RAW, "cpu", profile=DecodeProfile.default(CFG.resolutions))
    cache.put(ids, kv)
    k = cache.keys(ids)
    blob = bytearray(inner.get(blob_key(k[1], 0)))
    blob[-5] ^= 0xFF
    inner.put(blob_key(k[1], 0), bytes(blob))
    flaky = PrefixCache(
        DropsTheCheck(inner, k[2]), "model-a", RAW, "cpu", profile=DecodeProfile.default(CFG.resolutions)
    )
    r = flaky.fetch(ids, policy="fixed:0")
    assert isinstance(r.error, ChecksumError) and r.tokens_restored == 16 and r.stats.chunks_dropped == 1
    assert inner.exists_many([meta_key(x) for x in k]) == [True, False, True, True]


def test_corrupt_real_codec_blob_is_format_error():
    cache = PrefixCache(open_store("memory://"), "m", CFG, "cpu", policy="fixed:0")
    kv, ids = make_kv(32, layers=2), ids_for(32)
    cache.put(ids, kv)
    k = cache.keys(ids)
    blob = bytearray(cache.store.get(blob_key(k[1], 0)))
    blob[len(blob) // 2] ^= 0x55
    cache.store.put(blob_key(k[1], 0), bytes(blob))
    r = cache.fetch(ids, 32)
    assert isinstance(r.error, FormatError) and r.tokens_restored == 16


class SlowStore:
    """A real store whose gets take `delay` seconds (a slow link), and can be made to fail. A get
    of a key that `stalls(key)` holds waits for `release` (a stalled link), so a test of a deadline
    does not race the clock; a get that `meets` holds waits at `rendezvous` until another does."""

    def __init__(self, inner, delay, stalls=None, meets=None):
        self.inner, self.delay, self.fail_after = inner, delay, None
        self.stalls, self.release = stalls, threading.Event()
        self.meets, self.rendezvous = meets, threading.Barrier(2, timeout=60)
        self.url = "slow+" + inner.url
        self.gets = 0
        self._count = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, key):
        with self._count:
            self.gets += 1
            gets = self.gets
        if self.fail_after is not None and gets > self.fail_after:
            raise StoreError(f"{self.url}: connection refused (test)")
        if self.stalls is not None and self.stalls(key):
            self.release.wait(60)
        if self.meets is not None and self.meets(key):
            self.rendezvous.wait()  # BrokenBarrierError after 60 s: the gets were not in flight together
        time.sleep(self.delay)
        return self.inner.get(key)


def test_missing_blob_stops_and_heals(raw_cache):
    """An evicted blob: the fetch stops there, its meta is dropped, the next put rewrites it."""
    kv, ids = make_kv(64), ids_for(64)
    raw_cache.put(ids, kv)
    k = raw_cache.keys(ids)
    for j in range(2):
        raw_cache.store.delete(blob_key(k[2], j))
    r = raw_cache.fetch(ids, 64)
    assert isinstance(r.error, StoreError) and r.tokens_restored == 32
    assert raw_cache.lookup(ids) == 32
    assert raw_cache.put(ids, kv) == 1
    assert torch.equal(raw_cache.fetch(ids, 64).kv, kv)


def test_deadline_returns_restored_prefix(raw_cache):
    kv, ids = make_kv(160), ids_for(160)
    raw_cache.put(ids, kv)
    stalled = tuple(f"{k}/r" for k in raw_cache.keys(ids)[2:])  # chunks 2..9: their blobs never arrive
    slow = raw_cache.store = SlowStore(raw_cache.store, 0.0, stalls=lambda key: key.startswith(stalled))
    try:
        t = time.monotonic()
        r = raw_cache.fetch(ids, 160, deadline_s=2.0)
        took = time.monotonic() - t
    finally:
        slow.release.set()
    assert isinstance(r.error, FetchError) and "deadline" in str(r.error)
    assert r.tokens_restored == 32
    assert torch.equal(r.kv[:, :, : r.tokens_restored], kv[:, :, : r.tokens_restored])
    assert took < 30  # returned at its deadline, not when the stalled gets end (60 s)


def test_a_cancelled_fetch_stops_where_it_is(raw_cache):
    """cancelled() turning True (the engine's request was aborted) ends the fetch as a deadline
    would, with what was restored in order, though no deadline was set and a get is stalled."""
    kv, ids = make_kv(160), ids_for(160)
    raw_cache.put(ids, kv)
    gone = threading.Event()
    stalled = tuple(f"{k}/r" for k in raw_cache.keys(ids)[2:])

    def stalls(key):  # the client leaves once chunk 2's get has begun
        return key.startswith(stalled) and (gone.set() or True)

    slow = raw_cache.store = SlowStore(raw_cache.store, 0.0, stalls=stalls)
    try:
        r = raw_cache.fetch(ids, 160, cancelled=gone.is_set)
    finally:
        slow.release.set()
    assert isinstance(r.error, FetchError) and "cancelled" in str(r.error), r.error
    assert r.tokens_restored <= 32
    assert torch.equal(r.kv[:, :, : r.tokens_restored], kv[:, :, : r.tokens_restored])


def test_store_failure_mid_fetch(raw_cache):
    kv, ids = make_kv(100), ids_for(100)
    raw_cache.put(ids, kv)
    slow = SlowStore(raw_cache.store, 0.0)
    slow.fail_after = 3
    raw_cache.store = slow
    r = raw_cache.fetch(ids, 100)
    assert isinstance(r.error, StoreError) and r.tokens_restored == 48


def test_meta_query_failure_is_reported():
    class Down:
        url = "down://"

        def get_many(self, keys):
            raise StoreError("down:// unreachable")

    cache = PrefixCache(Down(), "m", RAW, "cpu")
    r = cache.fetch(ids_for(32), 32)
    assert isinstance(r.error, StoreError) and r.tokens_restored == 0


def test_inflight_is_bounded():
    """With a slow decoder, the network stage stays at most max_inflight chunks ahead."""
    seen = []
    codec = SlowCodec(
        RawCodec(chunk_tokens=16),
        0.01,
        before=lambda blob: seen.append(cache.store.gets if hasattr(cache.store, "gets") else 0),
    )
    cache = PrefixCache(open_store("memory://"), "m", codec, "cpu", max_inflight=2, policy="fixed:0")
    kv, ids = make_kv(160), ids_for(160)
    cache.put(ids, kv)
    cache.store = SlowStore(cache.store, 0.0)
    r = cache.fetch(ids, 160)
    assert r.ok and torch.equal(r.kv, kv)
    assert r.stats.peak_inflight <= 2
    # when chunk i starts decoding, at most i + 2 gets have been issued
    assert all(g <= i + 2 for i, g in enumerate(seen))


def test_parallel_gets_restore_in_order():
    cache = PrefixCache(
        open_store("memory://"),
        "m",
        RAW,
        "cpu",
        net_workers=3,
        max_inflight=4,
        profile=DecodeProfile.default(CFG.resolutions),
    )
    kv, ids = make_kv(200), ids_for(200)
    cache.put(ids, kv)
    first_two = tuple(f"{k}/r" for k in cache.keys(ids)[:2])
    cache.store = SlowStore(cache.store, 0.02, meets=lambda key: key.startswith(first_two))
    r = cache.fetch(ids, 200)  # the first two chunks' gets wait for each other: in flight together
    assert r.ok and torch.equal(r.kv, kv) and r.stats.peak_inflight <= 4


def test_stages_overlap():
    """Network and decode run concurrently: the fetch takes about max(stage), not the sum."""
    cache = PrefixCache(
        open_store("memory://"), "m", SlowCodec(RawCodec(chunk_tokens=16), 0.02), "cpu", policy="fixed:0"
    )
    kv, ids = make_kv(160), ids_for(160)
    cache.put(ids, kv)
    cache.store = SlowStore(cache.store, 0.02)
    r = cache.fetch(ids, 160)
    assert r.ok
    serial = r.stats.net_busy_s + r.stats.decode_busy_s
    assert r.stats.wall_s < 0.8 * serial


# -------------------------------------------------------------------------------- policies


def ctx(sizes, dec, gbit, backlog=0.0, remaining=0, workers=1):
    return ChoiceContext(sizes, dec, gbit * 1e9 / 8, backlog, workers, remaining, sizes, dec)


def test_adaptive_trades_bytes_for_decode_speed():
    sizes, dec = [1_000_000, 600_000], [0.001, 0.004]  # r0: big, fast; r1: small, slow
    pol = AdaptivePolicy()
    assert pol.choose(ctx(sizes, dec, 0.5, remaining=20)) == 1  # slow link: fewer bytes
    assert pol.choose(ctx(sizes, dec, 40, remaining=20)) == 0  # fast link: faster decode
    assert pol.choose(ctx(sizes, dec, 2.0, backlog=1.0, remaining=20)) == 0  # decoder behind
    assert MinBytesPolicy().choose(ctx(sizes, dec, 1)) == 1
    assert MinDecodePolicy().choose(ctx(sizes, dec, 1)) == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1000, 10**7), st.floats(1e-4, 0.1)), min_size=1, max_size=4),
    st.floats(0.1, 100),
    st.integers(0, 50),
    st.floats(0, 1),
)
def test_adaptive_never_predicts_worse_than_any_fixed_choice(opts, gbit, remaining, backlog):
    sizes, dec = [o[0] for o in opts], [o[1] for o in opts]
    c = ctx(sizes, dec, gbit, backlog, remaining)
    j = AdaptivePolicy().choose(c)
    assert predicted_finish(c, j) <= min(predicted_finish(c, k) for k in range(len(sizes))) + 1e-12


def test_get_policy_names():
    assert get_policy("fixed:512x512", CFG.resolutions).index == 1
    with pytest.raises(ConfigError):
        get_policy("fixed:999x999", CFG.resolutions)
    with pytest.raises(ConfigError):
        get_policy("nope")


@pytest.mark.parametrize("spec", ["fixed:2", "fixed:-1", "fixed:", "fixed:5x", "fixed:1x2x3", "fixed:ax512"])
def test_get_policy_refuses_a_fixed_resolution_the_codec_lacks(spec):
    with pytest.raises(ConfigError, match="policy"):
        get_policy(spec, CFG.resolutions)  # two frame sizes: indices 0 and 1


def test_prefix_cache_refuses_a_fixed_index_past_its_frame_sizes_at_once():
    with pytest.raises(ConfigError, match="fixed:7"):
        PrefixCache(open_store("memory://"), "m", CFG, "cpu", policy="fixed:7")


def test_bandwidth_estimator_tracks_rate_and_overlap():
    est = BandwidthEstimator(initial_gbit=1.0, alpha=0.5)
    t = 0.0
    for _ in range(20):  # 1 MB per 1 ms = 8 Gbit/s
        est.add(1_000_000, t, t + 0.001)
        t += 0.001
    assert abs(est.gbit - 8.0) < 0.01
    last = BandwidthEstimator(alpha=1.0)  # alpha 1: the estimate is the last sample
    last.add(1_000_000, 10.0, 10.002)
    assert abs(last.gbit - 4.0) < 0.01
    # a transfer overlapping the previous one is charged only the time since that one ended
    last.add(1_000_000, 10.0, 10.003)
    assert abs(last.gbit - 8.0) < 0.01
    last.begin()
    last.add(1_000_000, 20.0, 20.004)
    assert abs(last.gbit - 2.0) < 0.01


def test_bandwidth_estimator_latency_and_small_objects():
    est = BandwidthEstimator(initial_gbit=1.0, alpha=1.0)
    for lat in (0.004, 0.001, 0.003):  # a warm-up spike does not stick: min of the window
        est.add_latency(lat)
    assert est.latency_s == 0.001
    est.add(1_000_000, 0.0, 0.002)  # 2 ms = 1 ms latency + 1 MB at 8 Gbit/s
    assert abs(est.gbit - 8.0) < 0.01
    assert abs(est.transfer_s(2_000_000) - 0.003) < 1e-9
    est.add(100_000, 1.0, 1.002)  # 10x smaller object at 0.8 Gbit/s: weight 0.1, not 1
    assert 3.5 < est.gbit < 5.0  # spb 1e-9 + 0.1 * (1e-8 - 1e-9) -> 4.2 Gbit/s


def test_profile_calibration_cached(tmp_path):
    p1 = load_or_calibrate(RAW, "cpu", (2, 2, 32), directory=tmp_path)
    assert p1.source == "calibrated" and len(p1.seconds_per_value) == 2
    p2 = load_or_calibrate(RAW, "cpu", (2, 2, 32), directory=tmp_path)
    assert p2.source == "cache" and p2.seconds_per_value == p1.seconds_per_value
    assert (tmp_path / "decode-profiles.json").exists()
    p2.observe(0, 1000, 1.0)
    assert p2.seconds_per_value[0] > p1.seconds_per_value[0]


def test_a_cached_profile_of_other_frame_sizes_is_calibrated_again_not_used(tmp_path):
    """A codec whose id does not name its frame sizes (a benchmark baseline's did not) met the profile cached for
    another of its frame-size lists: the policy then asked it for a resolution it did not have."""
    one, two = (
        SlowCodec(RawCodec(("raw", "zstd"), chunk_tokens=16, resolutions=r), 0)
        for r in (CFG.resolutions[:1], CFG.resolutions)
    )
    one.id = two.id = "one-id-for-any-frame-sizes"
    assert load_or_calibrate(one, "cpu", (2, 2, 32), directory=tmp_path).resolutions == ((256, 256),)
    again = load_or_calibrate(two, "cpu", (2, 2, 32), directory=tmp_path)
    assert again.source == "calibrated" and again.resolutions == CFG.resolutions


def test_a_failure_on_the_network_thread_that_is_not_kvcodecs_fails_the_fetch_instead_of_hanging_it(raw_cache):
    """The network thread died of an IndexError (a profile of fewer resolutions than the codec) and the fetch
    waited for its chunks for ever; now the error is the fetch's."""
    kv, ids = make_kv(48), ids_for(48)
    raw_cache.put(ids, kv)
    raw_cache.profile = DecodeProfile.default(CFG.resolutions[:1])  # past the constructor's check of it
    r = raw_cache.fetch(ids, 48, deadline_s=30)  # were it to come back, the bug fails the test, not hangs it
    assert (
        r.tokens_restored == 0
        and isinstance(r.error, FetchError)
        and "chunk 0 failed to issue: IndexError" in str(r.error)
    )
    with pytest.raises(ConfigError, match="decode profile is of frame sizes"):
        PrefixCache(open_store("memory://"), "m", RAW, "cpu", profile=DecodeProfile.default(CFG.resolutions[:1]))
    with pytest.raises(ConfigError, match="net_workers"):
        PrefixCache(open_store("memory://"), "m", RAW, "cpu", net_workers=0)


def test_concurrent_fetches_share_cache(raw_cache):
    kv, ids = make_kv(64), ids_for(64)
    raw_cache.put(ids, kv)
    results = []
    ts = [threading.Thread(target=lambda: results.append(raw_cache.fetch(ids, 64))) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(r.ok and torch.equal(r.kv, kv) for r in results)


def test_shared_decoder_is_used_by_all_decode_workers():
    from kvcodec.video.registry import get_decoder

    real = get_decoder("cpu")
    calls = []

    class Counting:
        def decode(self, bitstream, width, height):
            calls.append(threading.get_ident())
            return real.decode(bitstream, width, height)

    # plain_fallback off: these small random chunks would otherwise be stored plain (no video)
    cfg = CodecConfig(
        sample_coder="hevc", chunk_tokens=16, resolutions=((256, 256),), search_layout=False, plain_fallback=False
    )
    cache = PrefixCache(
        open_store("memory://"),
        "m",
        HevcCodec(cfg, decoder=Counting()),
        "cpu",
        decode_workers=2,
        profile=DecodeProfile.default(cfg.resolutions),
    )
    kv, ids = make_kv(64, layers=2), ids_for(64)
    cache.put(ids, kv)
    r = cache.fetch(ids)
    assert r.ok and len(calls) == 4
    assert (r.kv.float() - kv.float()).abs().max() < 0.05


def test_adaptive_end_to_end_follows_the_link():
    """Real trade-off through the whole loop (bandwidth estimate + calibrated profile + policy):
    resolution 0 = raw bytes (big, instant decode), 1 = zstd (about 4x smaller, slower decode)."""
    from kvbench.net.throttle import ThrottledStore

    cfg = CodecConfig(chunk_tokens=64, resolutions=((256, 256), (512, 512)), search_layout=False)
    g = torch.Generator().manual_seed(0)
    kv = torch.randint(-3, 4, (4, 2, 1024, 4, 64), generator=g).half()  # compressible values
    ids = ids_for(1024)
    inner = open_store("memory://")
    codec = RawCodec(("raw", "zstd")).with_config(cfg)
    PrefixCache(inner, "m", codec, "cpu", profile=DecodeProfile.default(cfg.resolutions)).put(ids, kv)
    sizes = [len(b) for b in codec.encode_chunks(kv[:, :, :64])[0].blobs]
    assert sizes[1] * 3 < sizes[0]
    profile = None
    counts_by_rate = {}
    for gbit in (0.02, 50.0):
        cache = PrefixCache(
            ThrottledStore(inner, rate_gbit=gbit), "m", codec, "cpu", profile=profile, initial_gbit=10.0
        )  # the same prior for both links
        cache.ensure_profile((4, 4, 64))
        profile = cache.profile
        cache.fetch(ids)  # the bandwidth estimator learns the link (it persists across fetches)
        r = cache.fetch(ids)
        assert r.ok and torch.equal(r.kv, kv)
        counts_by_rate[gbit] = (r.stats.resolution_counts, cache.bandwidth.gbit)
    # slow link: the network dominates by 4x, zstd (fewer bytes) must win nearly every chunk, and
    # the estimate must have found the link (0.02 Gbit/s, from a prior of 10)
    slow, slow_est = counts_by_rate[0.02]
    assert slow.get("512x512", 0) >= 14 and slow_est < 0.3, counts_by_rate
    # fast link: the estimate must rise well above the slow one. Which resolution wins there is
    # NOT asserted: with per-get Python overheads on a loaded 2-core CPU the effective rate can be
    # ~1 Gbit/s, where zstd is the right choice; the policy's choice given its inputs is covered
    # by the deterministic policy tests above.
    fast_est = counts_by_rate[50.0][1]
    assert fast_est > 5 * slow_est, counts_by_rate


@pytest.mark.parametrize("codec", [RawCodec(), None], ids=["raw", "hevc"])
def test_direct_restore_into_out(codec):
    """The earlier call form (a CodecConfig and codec=) still works."""
    cfg = CodecConfig(chunk_tokens=16, resolutions=((256, 256),), search_layout=False)
    cache = PrefixCache(
        open_store("memory://"),
        "m",
        cfg,
        "cpu",
        codec=codec,
        direct=True,
        profile=DecodeProfile.default(cfg.resolutions),
    )
    kv, ids = make_kv(40, layers=2), ids_for(40)
    cache.put(ids, kv)
    ref = PrefixCache(cache.store, "m", cfg, "cpu", codec=codec, profile=cache.profile, direct=False).fetch(ids).kv
    out = torch.zeros((2, 2, 40, 2, 32), dtype=torch.float16)
    r = cache.fetch(ids, 40, out=out)
    assert r.ok and r.kv is out and torch.equal(out, ref)
    out32 = torch.zeros((2, 2, 40, 2, 32), dtype=torch.float32)  # other dtype: staged + converted
    assert torch.equal(cache.fetch(ids, 40, out=out32).kv, ref.float())


def test_direct_mode_never_writes_after_return():
    cache = PrefixCache(
        open_store("memory://"),
        "m",
        SlowCodec(RawCodec(chunk_tokens=16), 0.03),
        "cpu",
        direct=True,
        decode_workers=2,
        max_inflight=4,
        policy="fixed:0",
    )
    kv, ids = make_kv(160), ids_for(160)
    cache.put(ids, kv)
    out = torch.zeros((3, 2, 160, 2, 32), dtype=torch.float16)
    r = cache.fetch(ids, 160, out=out, deadline_s=0.05)
    assert isinstance(r.error, FetchError) and r.tokens_restored < 160
    snapshot = out.clone()
    time.sleep(0.1)
    assert torch.equal(out, snapshot)  # no decode worker wrote after fetch returned


def test_a_store_call_under_way_is_abandoned_when_its_fetch_is_cancelled():
    """storecalls.call with no deadline but a cancellation: the caller stops waiting for a stalled
    store call once cancelled() is True (the call itself finishes later on its worker thread);
    a cancelled() that raises counts as cancelled, never as a fetch that waits forever."""
    from kvcodec.fetcher import storecalls

    started, release, gone = threading.Event(), threading.Event(), threading.Event()

    def stalled():
        started.set()
        release.wait(60)
        return b"late"

    threading.Thread(target=lambda: (started.wait(60), gone.set()), daemon=True).start()
    try:
        with pytest.raises(FetchError, match="cancelled"):
            storecalls.call(storecalls.Deadline(None, cancelled=gone.is_set), "get", stalled)
    finally:
        release.set()
    assert storecalls.call(storecalls.Deadline(None, cancelled=lambda: False), "get", lambda: b"v") == b"v"
    assert storecalls.Deadline(None, cancelled=lambda: 1 / 0).passed
    answers = iter([False, True])  # a callback that says "cancelled" once, then "not" again
    flips = storecalls.Deadline(None, cancelled=lambda: next(answers, False))
    release.clear()
    try:
        with pytest.raises(FetchError, match="cancelled"):
            storecalls.call(flips, "get", stalled)
    finally:
        release.set()
    assert flips.passed and flips.ended() == "the fetch was cancelled"


def test_a_damaged_chunk_reported_after_the_fetch_closed_its_list_is_dropped_but_not_counted():
    """A decoder still at work when its fetch returns must not change the counts the caller already
    has (the fetch checks the chunks behind the first damaged one itself); the store still heals."""
    from kvcodec.fetcher.cache import BadChunks
    from kvcodec.fetcher.stats import FetchStats

    dropped, stats = [], FetchStats(policy="p", codec="c")
    bad = BadChunks(lambda i, e: dropped.append(i), stats, counts=True)
    bad.report(2, FormatError("chunk 2"))
    assert bad.close() == [2] and dropped == [2] and stats.chunks_dropped == 1
    bad.report(5, FormatError("chunk 5"))
    assert dropped == [2, 5] and bad.close() == [2] and stats.chunks_dropped == 1
