"""PrefixCache over every registered ChunkCodec: round trips, direct restore into dense and paged
targets, chunk binding (a blob served under another key is refused), healing, namespaces,
malformed metas and store calls bounded by the deadline."""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
import weakref

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcodec
from kvcodec.codecs import ChunkCodec, make_codec, registered_codecs
from kvcodec.errors import ConfigError, FetchError, FormatError, ShapeError
from kvcodec.fetcher import DecodeProfile, PrefixCache, blob_key, chunk_keys, meta_key
from kvcodec.restore.paged import PagedKV
from kvcodec.store import open_store

RES = ((256, 256), (512, 512))
# options that make each codec small and fast on this file's KV; other codecs get the common ones.
# hevc: no plain fallback, so that a chunk coded with its key (put) and without (reference) is the
# same int8 chunk (its size is near the plain threshold on this KV, and the key counts in it)
EXTRA = {
    "hevc": {"search_layout": False, "quant": "int8", "plain_fallback": False},
    "raw": {"variants": ("raw", "zstd")},
}


@pytest.fixture(scope="module")
def extra(tmp_path_factory) -> dict:
    """EXTRA plus a transform calibrated on KV of this file's shape (not the KV the tests fetch)."""
    from kvcodec.transform import RopeSpec, calibrate, save_kvt

    path = tmp_path_factory.mktemp("kvt") / "test.kvt"
    save_kvt(calibrate([make_kv(600, seed=s) for s in (11, 12)], RopeSpec(10000.0, 32), info={"model": "t"}), path)
    return {**EXTRA, "transform": {"transform": path}, "transform-ans": {"transform": path, "block": 4096}}


def build(name: str, extra: dict = EXTRA, chunk_tokens: int = 16) -> ChunkCodec:
    try:
        return make_codec(name, chunk_tokens=chunk_tokens, resolutions=RES, **extra.get(name, {}))
    except (TypeError, ConfigError) as e:
        pytest.skip(f"codec {name!r} does not take chunk_tokens/resolutions: {e}")


@pytest.fixture(params=registered_codecs())
def codec(request, extra) -> ChunkCodec:
    return build(request.param, extra)


def make_kv(tokens=40, layers=2, heads=2, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((layers, 2, tokens, heads, dim), generator=g).half()


def ids_for(n, offset=1000):
    return list(range(offset, offset + n))


def cache_for(codec, store=None, **kw) -> PrefixCache:
    kw.setdefault("profile", DecodeProfile.default(codec.resolutions))
    kw.setdefault("policy", "fixed:0")
    return PrefixCache(store or open_store("memory://"), "m", codec, "cpu", **kw)


def reference(codec: ChunkCodec, kv: torch.Tensor) -> torch.Tensor:
    """What the codec itself restores from its chunks (resolution 0)."""
    out = torch.empty_like(kv)
    for c in codec.encode_chunks(kv):
        codec.decode_chunk(c.blobs[0], out[:, :, c.start_token : c.start_token + c.tokens])
    return out


def test_builtins_registered_and_public():
    assert {"hevc", "raw"} <= set(registered_codecs())
    assert kvcodec.ChunkCodec is ChunkCodec
    assert isinstance(make_codec("raw"), kvcodec.ChunkCodec)
    with pytest.raises(ConfigError):
        make_codec("no-such-codec")


@pytest.mark.parametrize("name", registered_codecs())
def test_codec_id_covers_its_settings(name, extra):
    codec = build(name, extra)
    assert isinstance(codec, ChunkCodec) and codec.id
    assert build(name, extra).id == codec.id  # the same options give the same id
    assert build(name, extra, chunk_tokens=32).id != codec.id


def test_encode_chunks_numbers_keys_and_hands_out_chunks_in_order(codec):
    """The encode_chunks contract every codec shares: chunks numbered from first_chunk_index, each
    bound to its key, handed to on_chunk in order as made; a key count that is not the chunk count
    is a ShapeError before anything is coded."""
    kv, seen = make_kv(40), []
    keys = [f"k{n}" for n in range(3)]
    chunks = codec.encode_chunks(kv, first_chunk_index=2, keys=keys, on_chunk=seen.append)
    assert seen == chunks
    assert [(c.index, c.start_token, c.tokens) for c in chunks] == [(2, 32, 16), (3, 48, 16), (4, 64, 8)]
    assert [codec.inspect_chunk(c.blobs[0]).key for c in chunks] == keys
    with pytest.raises(ShapeError, match="2 keys given for 3 chunks"):
        codec.encode_chunks(kv, keys=keys[:2], on_chunk=seen.append)
    assert len(seen) == 3


@pytest.mark.parametrize(
    "name,options,decoders",
    [
        ("hevc", {"sample_coder": "zstd"}, "zstd-host"),  # was "ffmpeg-cpu": a decoder that never ran
        ("hevc", {"sample_coder": "hevc"}, "ffmpeg-cpu"),
        ("hevc", {}, "zstd-host+ffmpeg-cpu"),  # "auto" codes either
        ("transform", {"coder": "zstd"}, "zstd-host"),  # was the class name
        ("transform", {"coder": "mixed"}, "ffmpeg-cpu+zstd-host"),
    ],
)
def test_a_fetch_names_the_decoders_its_chunks_use(extra, name, options, decoders):
    kv, ids = make_kv(), ids_for(40)
    cache = cache_for(build(name, {name: {**extra.get(name, {}), **options}}))
    cache.put(ids, kv)
    assert cache.fetch(ids).stats.decoder == decoders


def test_fetch_roundtrip_and_direct_targets(codec):
    kv, ids = make_kv(), ids_for(40)
    cache = cache_for(codec)
    assert cache.put(ids, kv) == 3 and cache.lookup(ids) == 40
    ref = reference(codec, kv)
    r = cache.fetch(ids)
    assert r.ok and r.tokens_restored == 40 and torch.equal(r.kv, ref), r.error
    assert r.stats.codec == codec.id and r.stats.decoder
    out = torch.zeros((2, 2, 48, 2, 32), dtype=torch.float16)
    r = cache.fetch(ids, 35, out=out)
    assert r.ok and r.kv is out and torch.equal(out[:, :, :35], ref[:, :, :35]) and (out[:, :, 35:] == 0).all()
    pages = torch.zeros((2, 2, 8, 8, 2, 32), dtype=torch.float16)  # 8 blocks of 8 tokens
    table = torch.tensor([7, 2, 5, 0, 3])
    r = cache.fetch(ids, out=PagedKV(pages, table))
    assert r.ok and torch.equal(PagedKV(pages, table).gather(0, 40), ref)


def swap_blobs(cache: PrefixCache, ids_a, ids_b, chunk: int) -> None:
    """Write chunk `chunk` of prefix B (valid blobs of another prefix) at prefix A's key."""
    ka, kb = cache.keys(ids_a), cache.keys(ids_b)
    for j in range(len(cache.codec.resolutions)):
        cache.store.put(blob_key(ka[chunk], j), cache.store.get(blob_key(kb[chunk], j)))


def test_blob_of_another_prefix_is_refused_and_healed(codec):
    kv_a, kv_b = make_kv(seed=1), make_kv(seed=2)
    ids_a, ids_b = ids_for(40), ids_for(40, 5000)
    cache = cache_for(codec)
    cache.put(ids_a, kv_a)
    cache.put(ids_b, kv_b)
    swap_blobs(cache, ids_a, ids_b, 1)  # same index, start and shape: only the key differs
    r = cache.fetch(ids_a)
    # refused by its key, or earlier where its length differs from the meta's
    assert isinstance(r.error, FormatError) and ("another prefix" in str(r.error) or "bytes" in str(r.error))
    assert r.tokens_restored == 16 and r.stats.chunks_dropped == 1
    assert cache.lookup(ids_a) == 16  # the bad chunk is no longer reported
    assert cache.put(ids_a, kv_a) == 1  # ... and the next put rewrites it
    r = cache.fetch(ids_a)
    want = reference(codec, kv_a)  # chunk 1 as the put coded it: a run of its own (transform: its own finer tail)
    codec.decode_chunk(codec.encode_chunks(kv_a[:, :, 16:32], first_chunk_index=1)[0].blobs[0], want[:, :, 16:32])
    assert r.ok and torch.equal(r.kv, want)


def test_blob_at_the_wrong_position_is_refused(codec):
    kv, ids = make_kv(48), ids_for(48)
    cache = cache_for(codec)
    cache.put(ids, kv)
    k = cache.keys(ids)
    cache.store.put(blob_key(k[2], 0), cache.store.get(blob_key(k[1], 0)))
    r = cache.fetch(ids)
    assert isinstance(r.error, FormatError) and r.tokens_restored == 32


def test_corrupted_blob_is_dropped_and_rewritten(codec):
    kv, ids = make_kv(), ids_for(40)
    cache = cache_for(codec)
    cache.put(ids, kv)
    key = blob_key(cache.keys(ids)[0], 0)
    blob = bytearray(cache.store.get(key))
    blob[-3] ^= 0x40
    cache.store.put(key, bytes(blob))
    r = cache.fetch(ids)
    assert isinstance(r.error, FormatError) and r.tokens_restored == 0
    assert cache.lookup(ids) == 0 and cache.put(ids, kv) == 1
    assert cache.fetch(ids).ok


@pytest.mark.parametrize(
    "meta",
    [
        b"not json",
        b"[1, 2]",
        b'{"v": 1}',
        b"{}",
        b'{"v":1,"index":0,"start_token":0,"tokens":16,"shape":[2,2],"dtype":"float16",'
        b'"resolutions":[[256,256],[512,512]],"sizes":[10,10],"codec":"x"}',
        b'{"v":1,"index":0,"start_token":0,"tokens":16,"shape":[2,-2,32],"dtype":"float16",'
        b'"resolutions":[[256,256],[512,512]],"sizes":[10,10],"codec":"x"}',
        b'{"v":1,"index":0,"start_token":0,"tokens":16,"shape":[2,2,32],"dtype":{"a":1},'
        b'"resolutions":[[256,256],[512,512]],"sizes":[10,10],"codec":"x"}',
    ],
)
def test_malformed_meta_is_a_clean_error_and_heals(meta):
    codec = build("raw")
    kv, ids = make_kv(), ids_for(40)
    cache = cache_for(codec)
    cache.put(ids, kv)
    cache.store.put(meta_key(cache.keys(ids)[1]), meta)
    r = cache.fetch(ids)
    assert isinstance(r.error, FormatError) and r.tokens_restored == 16
    assert cache.lookup(ids) == 16 and cache.put(ids, kv) == 1 and cache.fetch(ids).ok


def test_namespace_separates_tenants():
    codec = build("raw")
    kv, ids = make_kv(), ids_for(40)
    store = open_store("memory://")
    a, b = cache_for(codec, store, namespace="tenant-a"), cache_for(codec, store, namespace="tenant-b")
    a.put(ids, kv)
    assert a.lookup(ids) == 40 and b.lookup(ids) == 0 and cache_for(codec, store).lookup(ids) == 0
    assert not b.fetch(ids).ok
    assert chunk_keys(ids, "m", codec, namespace="tenant-a") == a.keys(ids)
    assert chunk_keys(ids, "m", codec) != a.keys(ids)


class StalledStore:
    """A real store whose calls block while `stalled` is set (a paused server)."""

    def __init__(self, inner):
        self.inner, self.url, self.stalled = inner, "stalled+" + inner.url, threading.Event()

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args):
            while self.stalled.is_set():
                time.sleep(0.01)
            return attr(*args)

        return call


@pytest.mark.parametrize("stall", ["meta", "blob"])
def test_deadline_covers_every_store_call(stall):
    codec = build("raw")
    kv, ids = make_kv(), ids_for(40)
    store = StalledStore(open_store("memory://"))
    cache = cache_for(codec, store)
    cache.put(ids, kv)
    release = threading.Event()  # a stalled call waits for it (60 s at most), far past the deadline
    if stall == "blob":
        cache.fetch(ids)  # warm
        real_get = store.inner.get

        def slow_get(key):
            if key.endswith("/r0") and key.startswith(cache.keys(ids)[1]):
                release.wait(60)
            return real_get(key)

        store.inner.get = slow_get
    else:
        store.stalled.set()
    try:
        t = time.monotonic()
        r = cache.fetch(ids, deadline_s=2.0 if stall == "blob" else 0.3)  # chunk 0 restores well within 2 s
        took = time.monotonic() - t
    finally:
        store.stalled.clear()
        release.set()
    assert isinstance(r.error, FetchError) and "deadline" in str(r.error) and took < 30, (took, r.error)
    assert r.tokens_restored == (16 if stall == "blob" else 0)
    if stall == "meta":
        store.stalled.set()
        try:
            t = time.monotonic()
            with pytest.raises(FetchError):
                cache.lookup(ids, deadline_s=0.2)
            assert time.monotonic() - t < 30
        finally:
            store.stalled.clear()


def test_earlier_call_form_still_works():
    cfg = kvcodec.CodecConfig(chunk_tokens=16, resolutions=RES, search_layout=False)
    c = PrefixCache(open_store("memory://"), "m", cfg, "cpu")
    assert c.codec.id == make_codec("hevc", config=cfg).id and c.config == cfg
    from kvcodec.codecs.raw import RawCodec

    r = PrefixCache(open_store("memory://"), "m", cfg, "cpu", codec=RawCodec())
    assert r.chunk_tokens == 16 and r.codec.resolutions == RES
    with pytest.raises(ConfigError):
        PrefixCache(open_store("memory://"), "m", RawCodec(), "cpu", codec=RawCodec())


@pytest.mark.parametrize("edit", [{"shape": [2**31, 2, 32]}, {"shape": [2**63, 2, 32]}, {"sizes": [5, 5]}])
def test_consistent_looking_meta_edits_never_size_an_allocation(edit):
    """A meta edited consistently (valid JSON, right codec id) is checked against the blob's own
    header before anything is allocated from it."""
    import json

    codec = build("raw")
    kv, ids = make_kv(), ids_for(40)
    cache = cache_for(codec)
    cache.put(ids, kv)
    key = meta_key(cache.keys(ids)[0])
    cache.store.put(key, json.dumps({**json.loads(cache.store.get(key)), **edit}).encode())
    r = cache.fetch(ids)
    assert isinstance(r.error, FormatError) and r.tokens_restored == 0 and r.kv is None
    assert cache.lookup(ids) == 0 and cache.put(ids, kv) == 1 and cache.fetch(ids).ok


def test_a_later_meta_disagreeing_with_chunk_0_is_dropped_and_healed():
    """Chunk 1's meta edited to another dtype: chunk 0 restores, which shows chunk 1's meta is the
    damaged one; it is dropped, and the next put rewrites only it."""
    import json

    codec = build("raw")
    kv, ids = make_kv(), ids_for(40)
    cache = cache_for(codec)
    cache.put(ids, kv)
    key = meta_key(cache.keys(ids)[1])
    cache.store.put(key, json.dumps({**json.loads(cache.store.get(key)), "dtype": "bfloat16"}).encode())
    r = cache.fetch(ids)
    assert isinstance(r.error, FormatError) and r.tokens_restored == cache.chunk_tokens
    assert cache.put(ids, kv) == 1 and cache.fetch(ids).ok


@pytest.mark.parametrize(
    "edit",
    [{"index": "x"}, {"start_token": -1}, {"key": 5}, {"raw_bytes": 1 << 40}, {"variant": "lz4", "raw_bytes": 1 << 30}],
)
def test_raw_chunk_headers_forged_with_valid_checksums_are_format_errors(edit):
    from kvcodec.codecs.raw import MAGIC, RawCodec
    from kvcodec.container.format import read_object, write_object

    codec = RawCodec(chunk_tokens=16, resolutions=RES)
    blob = codec.encode_chunks(make_kv())[0].blobs[0]
    header, payload = read_object(blob, MAGIC, "raw")
    forged = write_object(MAGIC, {**header, **edit}, [bytes(payload)])
    with pytest.raises(FormatError):
        codec.inspect_chunk(forged)


# -- staged decode (codecs.base.StagedDecode): the batched second half in the fetch path ---------


def within_an_ulp(a: torch.Tensor, b: torch.Tensor) -> bool:
    """fp16 values equal up to the last bit's rounding (the batched math sums in another order)."""
    return torch.allclose(a.float(), b.float(), rtol=2**-10, atol=2**-12)


def staged_spy(codec) -> list[int]:
    """The sizes of the batches the codec's finish is called with; decode_chunk must not run."""
    sizes: list[int] = []
    finish = codec.finish

    def counted(staged, outs):
        sizes.append(len(staged))
        finish(staged, outs)

    def refused(blob, out):
        raise AssertionError("a staged fetch called decode_chunk")

    codec.finish, codec.decode_chunk = counted, refused
    return sizes


def test_staged_fetch_restores_every_target_through_batched_finishes(extra):
    codec = build("transform", extra)
    assert isinstance(codec, kvcodec.codecs.base.StagedDecode)
    kv, ids = make_kv(80, seed=3), ids_for(80)
    ref = reference(codec, kv)
    cache = cache_for(codec, batched_restore=True, decode_workers=3, max_inflight=8)
    assert cache.put(ids, kv) == 5
    sizes = staged_spy(codec)
    r = cache.fetch(ids)
    assert r.ok and r.tokens_restored == 80 and within_an_ulp(r.kv, ref), r.error
    assert sum(sizes) == 5 and r.stats.chunks_restored == 5
    out = torch.zeros((2, 2, 48, 2, 32), dtype=torch.float16)
    r = cache.fetch(ids, 35, out=out)  # the third chunk goes through a staging tensor
    assert r.ok and r.kv is out and within_an_ulp(out[:, :, :35], ref[:, :, :35]) and (out[:, :, 35:] == 0).all()
    pages = torch.zeros((2, 2, 12, 8, 2, 32), dtype=torch.float16)
    table = torch.tensor([7, 2, 5, 0, 3, 11, 9, 1, 4, 10])
    r = cache.fetch(ids, out=PagedKV(pages, table))
    assert r.ok and within_an_ulp(PagedKV(pages, table).gather(0, 80), ref)
    r = cache_for(codec, store=cache.store, batched_restore=True, direct=False).fetch(ids)
    assert r.ok and within_an_ulp(r.kv, ref)


def test_staged_fetch_stops_at_a_damaged_or_foreign_chunk(extra):
    codec = build("transform", extra)
    kv_a, ids_a, ids_b = make_kv(64, seed=4), ids_for(64), ids_for(64, 7000)
    cache = cache_for(codec, batched_restore=True, decode_workers=2, max_inflight=8)
    cache.put(ids_a, kv_a)
    cache.put(ids_b, kv_a)  # the same values: blobs of the same size that differ in their key only
    ref_a = reference(codec, kv_a)
    staged_spy(codec)
    key = blob_key(cache.keys(ids_a)[2], 0)
    blob = bytearray(cache.store.get(key))
    blob[-3] ^= 0x40
    cache.store.put(key, bytes(blob))
    r = cache.fetch(ids_a)
    assert isinstance(r.error, FormatError) and r.tokens_restored == 32 and r.stats.chunks_dropped == 1
    assert within_an_ulp(r.kv[:, :, :32], ref_a[:, :, :32])
    assert cache.lookup(ids_a) == 32
    swap_blobs(cache, ids_b, ids_a, 1)  # a valid blob of another prefix
    r = cache.fetch(ids_b)
    assert isinstance(r.error, FormatError) and "another prefix" in str(r.error) and r.tokens_restored == 16


def third_finish_fails(codec) -> list[int]:
    """The sizes of the batches the codec's finish is called with; its third call raises."""
    finish, sizes = codec.finish, []

    def third_fails(staged, outs):
        sizes.append(len(staged))
        if len(sizes) == 3:
            raise RuntimeError("kernel launch failed")
        finish(staged, outs)

    codec.finish = third_fails
    return sizes


def test_staged_fetch_reports_a_failing_finish_and_keeps_what_came_before(extra):
    codec = build("transform", extra)
    kv, ids = make_kv(64, seed=6), ids_for(64)
    cache = cache_for(codec, batched_restore=True, max_inflight=1)  # one chunk per finish
    cache.put(ids, kv)
    third_finish_fails(codec)
    r = cache.fetch(ids)
    assert isinstance(r.error, FetchError) and "chunk 2" in str(r.error) and r.tokens_restored == 32


@pytest.mark.parametrize("name", ["raw", "hevc"])
def test_codecs_without_staged_decode_fetch_as_before_when_batched_is_asked(name, extra):
    codec = build(name, extra)
    assert not isinstance(codec, kvcodec.codecs.base.StagedDecode)
    kv, ids = make_kv(), ids_for(40)
    cache = cache_for(codec, batched_restore=True)
    cache.put(ids, kv)
    r = cache.fetch(ids)
    assert r.ok and torch.equal(r.kv, reference(codec, kv))


def test_transform_fetch_on_the_cpu_is_not_staged_unless_asked(extra):
    codec = build("transform", extra)
    kv, ids = make_kv(48, seed=7), ids_for(48)
    cache = cache_for(codec)
    cache.put(ids, kv)
    codec.finish = None  # never called: the CPU default is decode_chunk per chunk
    r = cache.fetch(ids)
    assert r.ok and torch.equal(r.kv, reference(codec, kv))


@pytest.mark.parametrize("streamed", [False, True])
def test_staged_fetch_past_its_deadline_returns_without_waiting_for_stages(extra, streamed):
    codec = build("transform", extra)
    kv, ids = make_kv(64, seed=8), ids_for(64)
    cache = cache_for(codec, batched_restore=True, decode_workers=2)
    cache.put(ids, kv)
    stage, stage_stream = codec.stage, codec.stage_stream

    release = threading.Event()  # a stage waits for it (60 s at most), far past the deadline

    def slow(blob, out):
        release.wait(60)  # a stage never writes into the target: nothing to wait for
        return stage(blob, out)

    def slow_stream(items, device, check=None):
        for done in stage_stream(items, device, check):
            release.wait(60)
            yield done

    if streamed:
        codec.stage_stream = slow_stream
    else:
        codec.stage, codec.stage_stream = slow, None
    try:
        t0 = time.monotonic()
        r = cache.fetch(ids, deadline_s=0.3)
        took = time.monotonic() - t0
    finally:
        release.set()
    assert isinstance(r.error, FetchError) and r.tokens_restored == 0
    assert took < 30


class _CountingQueue(queue.Queue):
    """A queue that says when `n` items have been put in it (however many were taken since)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.puts, self.all_in = n, 0, threading.Event()

    def put(self, item, block=True, timeout=None):  # noqa: ANN001 - queue.Queue's signature
        super().put(item, block, timeout)
        with self.mutex:
            self.puts += 1
            if self.puts >= self.n:
                self.all_in.set()


def first_finish_waits_for_all(codec, chunks: int, monkeypatch) -> list[int]:
    """The sizes of the batches the codec's finish is called with; its first call returns only
    once every one of the fetch's `chunks` decode results is queued, so the rest are ready
    together after it."""
    from kvcodec.fetcher import pipeline

    results = _CountingQueue(chunks)  # the fetch's decode results: one per chunk
    init = pipeline.FetchPipeline.__init__

    def counted(self, *a, **kw):
        init(self, *a, **kw)
        self.res_q = results

    monkeypatch.setattr(pipeline.FetchPipeline, "__init__", counted)
    finish, sizes = codec.finish, []

    def first_waits_for_all(staged, outs):
        sizes.append(len(staged))
        if len(sizes) == 1:
            assert results.all_in.wait(60), "the decode workers did not stage every chunk"
        finish(staged, outs)

    codec.finish = first_waits_for_all
    return sizes


def chunk_bytes(kv: torch.Tensor, chunk_tokens: int = 16) -> int:
    """fp16 bytes of one chunk of `kv` (layers, 2, tokens, heads, dim)."""
    L, _, _, H, D = kv.shape
    return L * 2 * chunk_tokens * H * D * 2


@pytest.mark.parametrize("bound", [None, 2], ids=["default-bound", "two-chunks"])
def test_staged_fetch_finishes_the_chunks_ready_together_in_batches_within_the_bound(extra, monkeypatch, bound):
    from kvcodec.fetcher import pipeline

    codec = build("transform", extra)
    kv, ids = make_kv(96, seed=9), ids_for(96)
    ref = reference(codec, kv)
    cache = cache_for(codec, batched_restore=True, decode_workers=3, max_inflight=8)
    cache.put(ids, kv)
    if bound is not None:
        monkeypatch.setattr(pipeline, "FINISH_BATCH_BYTES", bound * chunk_bytes(kv))
    sizes = first_finish_waits_for_all(codec, 6, monkeypatch)
    r = cache.fetch(ids)
    assert r.ok and within_an_ulp(r.kv, ref), r.error
    assert sum(sizes) == 6, sizes
    if bound is None:  # the chunks queued while the first finish ran are finished together: two calls at most
        assert len(sizes) <= 2, sizes
    else:  # one run, cut in batches of the bound
        assert max(sizes) == bound, sizes


def test_a_failing_finish_batch_keeps_the_batches_before_it(extra, monkeypatch):
    from kvcodec.fetcher import pipeline

    codec = build("transform", extra)
    kv, ids = make_kv(96, seed=10), ids_for(96)
    cache = cache_for(codec, batched_restore=True, decode_workers=3, max_inflight=8)
    cache.put(ids, kv)
    monkeypatch.setattr(pipeline, "FINISH_BATCH_BYTES", 2 * chunk_bytes(kv))
    sizes = third_finish_fails(codec)
    r = cache.fetch(ids)
    done = sum(sizes[:2])
    assert isinstance(r.error, FetchError) and f"chunk {done}" in str(r.error) and r.tokens_restored == 16 * done
    assert within_an_ulp(r.kv[:, :, : 16 * done], reference(codec, kv)[:, :, : 16 * done])


@given(st.lists(st.integers(1, 50), max_size=30), st.integers(1, 120))
def test_finish_batches_cut_in_order_within_the_bound(nbytes, most):
    from kvcodec.fetcher.pipeline import finish_batches

    runs = finish_batches(list(range(len(nbytes))), nbytes, most)
    assert [i for run in runs for i in run] == list(range(len(nbytes)))
    for k, run in enumerate(runs):
        size = sum(nbytes[i] for i in run)
        assert run and (size <= most or len(run) == 1)
        if k:  # a run starts only where its first item would not fit in the run before
            assert sum(nbytes[i] for i in runs[k - 1]) + nbytes[run[0]] > most


def output_freed_without_gc(cache: PrefixCache, ids: list[int]) -> bool:
    """A fetch of `ids` succeeds, and the output it allocated is freed as soon as its result is
    dropped, with the garbage collector off (no reference cycle keeps it). A decode thread that a
    loaded machine has not yet run to its end still holds its frame for a moment: the output must be
    gone once the threads have run (waited for up to 30 s, not joined: a thread's own data must not
    keep it either)."""
    gc.collect()
    gc.disable()
    try:
        r = cache.fetch(ids)
        assert r.ok, r.error
        output = weakref.ref(r.kv)
        del r
        deadline = time.monotonic() + 30
        while output() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        return output() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("batched", [None, True])
def test_a_fetch_output_is_freed_once_the_caller_drops_it(codec, batched):
    kv, ids = make_kv(48, seed=12), ids_for(48)
    cache = cache_for(codec, batched_restore=batched)
    cache.put(ids, kv)
    assert output_freed_without_gc(cache, ids)


def cyclic_buffers(run) -> list[str]:  # noqa: ANN001 - run: () -> None
    """The types of the tensors and Futures that `run` left in reference cycles (with the collector off
    meanwhile, and logging too: a captured log record would keep an error, and so its cycle, alive):
    a buffer in a cycle lives until the collector's next full pass."""
    from concurrent.futures import Future

    was_enabled, debug = gc.isenabled(), gc.get_debug()
    gc.collect()
    gc.garbage.clear()
    gc.disable()
    logging.disable(logging.CRITICAL)
    try:
        run()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        return sorted(type(o).__name__ for o in gc.garbage if isinstance(o, (torch.Tensor, Future)))
    finally:
        logging.disable(logging.NOTSET)
        gc.set_debug(debug)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()


def test_a_fetch_frees_its_buffers_without_the_collector(codec):
    """Fetches that succeed, one refused at two damaged chunks and one cut off by its deadline with a store
    call in flight (whose worker reports after the fetch has ended) leave no tensor or Future in a cycle
    (tests/test_fetcher_gpu.py checks the driven CUDA paths)."""
    kv, ids = make_kv(tokens=100), ids_for(100)
    store = open_store("memory://")
    cache = cache_for(codec, store)
    assert cache.put(ids, kv) == 7
    assert cache.fetch(ids).ok  # first use: threads and tables made and kept
    release, real_get = threading.Event(), store.get

    def get(key):  # noqa: ANN001, ANN202
        if key == blob_key(cache.keys(ids)[5], 0):
            release.wait(60)
        return real_get(key)

    def fetches() -> None:
        for _ in range(3):
            assert cache.fetch(ids).ok
        for c in (2, 4):
            key = blob_key(cache.keys(ids)[c], 0)
            blob = bytearray(store.get(key))
            blob[len(blob) // 2] ^= 0xFF
            store.put(key, bytes(blob))
        r = cache.fetch(ids)
        assert not r.ok and r.tokens_restored == 32
        cache.put(ids, kv)  # the refused chunks rewritten
        store.get = get
        try:
            r = cache.fetch(ids, deadline_s=0.5)
        finally:
            release.set()
        assert "deadline" in str(r.error) and r.tokens_restored <= 80
        del r
        cache._executor.shutdown(wait=True)  # every stage thread done, the stalled one's report included

    assert cyclic_buffers(fetches) == []


_META_FIELDS = st.fixed_dictionaries(
    {
        "v": st.sampled_from([1, 1, 1, 2]),
        "index": st.integers(-1, 3),
        "start_token": st.integers(0, 512),
        "tokens": st.integers(0, 256),
        "shape": st.lists(st.integers(0, 64), min_size=2, max_size=4),
        "dtype": st.sampled_from(["float16", "bfloat16", "int9"]),
        "resolutions": st.lists(st.lists(st.integers(16, 1024), min_size=2, max_size=2), max_size=2),
        "sizes": st.lists(st.integers(0, 10**6), max_size=2),
        "codec": st.just("c"),
    }
)


@given(_META_FIELDS, st.sampled_from([bytearray, lambda b: b.decode(), memoryview, lambda b: None]))
def test_a_meta_parses_the_same_every_time_and_from_other_objects_as_before(fields, other):
    """ChunkMeta.from_bytes keeps the metas it parsed by their bytes: the same bytes give an equal meta or
    the same error every time, as a parse of its own (the uncached ChunkMeta._parse); what is not bytes
    (another buffer, a str, None) is parsed or refused by that parse, uncached: a FormatError, never another."""
    import json

    from kvcodec.fetcher import ChunkMeta

    raw = json.dumps(fields).encode()
    outcomes = []
    for parse, given_ in ((ChunkMeta.from_bytes, raw), (ChunkMeta.from_bytes, raw), (ChunkMeta._parse, raw)):
        try:
            outcomes.append(parse(given_))
        except FormatError as e:
            outcomes.append(str(e))
    assert outcomes[0] == outcomes[1] == outcomes[2]
    try:
        from_other = ChunkMeta.from_bytes(other(raw))
    except FormatError as e:
        from_other = str(e)
    try:
        parsed_other = ChunkMeta._parse(other(raw))
    except FormatError as e:
        parsed_other = str(e)
    assert from_other == parsed_other
    if isinstance(outcomes[0], ChunkMeta):
        assert ChunkMeta.from_bytes(outcomes[0].to_bytes()) == outcomes[0]
