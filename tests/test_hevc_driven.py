"""The HEVC codec in the driven restore (codecs/driven.py, codecs/hevc/driven.py).

On the CPU, StageDriver runs over stand-in sessions that decode with FFmpeg straight into each
piece's buffer (test_transform_batch.FakeDecoder): one-stream and split chunks (a piece per part,
spread over the sessions), a plain chunk, a refused chunk, a session that fails. On CUDA (skipped
without NVDEC and the native feeder): PrefixCache.fetch driven by default, against the worker path
and the CPU fetch; a damaged chunk stops the fetch there and leaves the sessions good."""

from __future__ import annotations

import dataclasses
import threading
import types

import pytest
import torch

from kvcodec.codecs.driven import StageDriver, driven_of
from kvcodec.codecs.hevc.codec import HevcCodec
from kvcodec.codecs.hevc.decode import decode_chunk_blob
from kvcodec.config import CodecConfig
from kvcodec.container.format import CHUNK_MAGIC, StreamEntry, crc32, parse_chunk, split_streams, write_object
from kvcodec.errors import FormatError, KVCodecError
from test_transform_batch import FakeDecoder

CFG = CodecConfig(sample_coder="hevc", chunk_tokens=128, resolutions=((144, 144),), search_layout=False)


def _kv(tokens: int, layers: int = 4, heads: int = 2, dim: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn((layers, 2, tokens, heads, dim), generator=g).half()


def _chunks(config: CodecConfig, tokens: int = 513):
    codec = HevcCodec(config)
    kv = _kv(tokens)
    chunks = codec.encode_chunks(kv)
    ref = [decode_chunk_blob(ch.blobs[0]) for ch in chunks]
    return codec, kv, chunks, ref


def _drive(driver, chunks, outs, flush) -> dict:
    for i, ch in enumerate(chunks):
        driver.submit(i, ch.blobs[0], outs[i])
    got: dict = {}
    for _ in range(10_000):  # the stand-in sessions decode synchronously: a chunk never handed back is a failure
        if len(got) == len(chunks):
            return got
        got.update((tag, part) for tag, part, _ in driver.poll())
        _wait_for_host(driver)
        flush()
    raise AssertionError(f"chunks never handed back: {sorted(set(range(len(chunks))) - set(got))}")


def _wait_for_host(driver) -> None:
    """Every chunk on the host pool (a plain one) waited for, so a loop of polls never races the
    pool's threads on a loaded machine (the bound only turns a hang into a failure)."""
    for tag in list(driver.on_host):
        driver.wait(tag, 60.0, flush=False)


def test_chunks_are_prepared_while_their_videos_decode_and_restore_the_same():
    """A wait with chunks not yet prepared prepares the oldest instead of blocking (side streams
    uploaded, restorer made while NVDEC decodes); those chunks restore as decode_chunk_blob does."""
    codec, kv, chunks, ref = _chunks(CFG)
    outs = [torch.full_like(r, float("nan")) for r in ref]
    driver = StageDriver(codec, [FakeDecoder(None) for _ in range(2)])
    for i, ch in enumerate(chunks):
        driver.submit(i, ch.blobs[0], outs[i])
    coded = [i for i in range(len(chunks)) if i in driver.fed]  # chunks with videos (a plain one is on the host pool)
    assert list(driver.unprepared) == coded and len(coded) >= 2
    driver.wait(coded[0], 10.0, flush=False)  # returns at once: it prepared chunk coded[0]
    assert list(driver.unprepared) == coded[1:] and driver.fed[coded[0]].prepared
    assert all(p.restorer is not None for p in driver.fed[coded[0]].reading.state)
    while driver.prepare_one():
        pass
    got: dict = {}
    for _ in range(10_000):
        if len(got) == len(chunks):
            break
        got.update((tag, part) for tag, part, _ in driver.poll())
        _wait_for_host(driver)
        driver.end_all()
    driver.close()
    driver.finish([got[i] for i in sorted(got)], [outs[i] for i in sorted(got)])
    for i in sorted(got):
        assert torch.equal(outs[i], ref[i]), i


@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize("sessions,fail", [(1, None), (3, None), (3, (3, 0))])
def test_the_driver_restores_hevc_chunks_as_decode_chunk_does(streams, sessions, fail):
    """Every chunk restored as decode_chunk_blob restores it, split or not (a piece per part), a
    chunk refused by its check is that chunk's error, a plain chunk (the last token) needs no
    session; after a session fails, each chunk with a piece there is decoded on its own."""
    codec, kv, chunks, ref = _chunks(CFG if streams == 1 else CodecConfig(**{**CFG.to_dict(), "streams_per_chunk": 3}))
    assert driven_of(codec) is not None and chunks[-1].tokens == 1
    outs = [torch.full_like(r, float("nan")) for r in ref]

    def check(tag, info):
        if tag == 2:
            raise FormatError("refused by its check")

    decoders = [FakeDecoder(fail) for _ in range(sessions)]
    driver = StageDriver(codec, decoders, check)
    got = _drive(driver, chunks, outs, driver.end_all if sessions == 1 else driver.flush_stuck)
    driver.close()
    assert sorted(got) == list(range(len(chunks))) and isinstance(got[2], FormatError)
    ok = sorted(i for i in got if i != 2)
    driver.finish([got[i] for i in ok], [outs[i] for i in ok])
    for i in ok:
        assert torch.equal(outs[i], ref[i]), i
    streamed = sorted(k for d in decoders for k in d.run.streams)
    pieces = [(i, p) for i in ok[:-1] for p in range(streams)]  # the plain last chunk has no video
    assert streamed == pieces  # every piece streamed once
    failed = [d for d in decoders if fail in d.run.streams]
    assert sum(d.decoded_alone for d in decoders) == (
        len({t for t, _ in failed[0].run.streams}) * streams if fail else 0
    )
    assert all(d.run.feeder is None for d in decoders)  # closed


def test_a_codec_with_a_pool_or_a_fixed_decoder_is_not_driven():
    assert driven_of(HevcCodec(CFG, decoder=object())) is None
    pool = types.SimpleNamespace(device=torch.device("cuda", 0), restore_blobs=None)  # what a codec asks of one
    assert driven_of(HevcCodec(CFG, pool=pool)) is None
    assert driven_of(object()) is None


# ------------------------------------------------------------------------------------ CUDA


def _nvdec() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kvcodec.video import nvcuvid_native
    from kvcodec.video.nvcuvid import NvcuvidDecoder

    if not (NvcuvidDecoder.is_available() and nvcuvid_native.available()):
        pytest.skip("needs NVDEC and the native feeder")


def _caches(config: CodecConfig, tokens: int = 700):
    from kvcodec.fetcher import DecodeProfile, PrefixCache
    from kvcodec.store import open_store

    store, ids = open_store("memory://"), list(range(tokens))
    caches = [
        PrefixCache(store, "m", config, dev, profile=DecodeProfile.default(config.resolutions))
        for dev in ("cpu", "cuda")
    ]
    assert caches[0].put(ids, _kv(tokens)) == -(-tokens // config.chunk_tokens)
    return caches, ids, store


GPU_CFG = CodecConfig(sample_coder="hevc", chunk_tokens=64, resolutions=((256, 256), (512, 512)), search_layout=False)


@pytest.mark.gpu
@pytest.mark.parametrize("streams", [1, 2])
@pytest.mark.parametrize("driven", [True, False])
def test_hevc_fetch_on_cuda_is_driven_and_matches_the_cpu_fetch(driven, streams, monkeypatch):
    """The default fetch of HEVC chunks on CUDA: the caller's thread drives every NVDEC session
    (driven False: decode worker threads), whole and split chunks, both frame sizes (the adaptive
    policy mixes them), a dense target and a paged one; all restore what the CPU does."""
    from kvcodec.codecs import driven as driven_module
    from kvcodec.restore.paged import PagedKV

    _nvdec()
    monkeypatch.setattr(driven_module, "DRIVEN", driven)
    config = CodecConfig(**{**GPU_CFG.to_dict(), "streams_per_chunk": streams})
    (cpu, gpu), ids, _ = _caches(config)
    ref = cpu.fetch(ids).kv.float()
    for policy in ("fixed:0", "fixed:1", "adaptive", "fixed:0"):  # the last one reuses the sessions
        r = gpu.fetch(ids, policy=policy)
        assert r.ok, r.error
        torch.testing.assert_close(r.kv.cpu().float(), ref, atol=1e-3, rtol=0)
    assert ({t.worker for t in r.stats.timeline} == {threading.current_thread().name}) == driven
    pages = torch.zeros((4, 2, 12, 64, 2, 64), dtype=torch.float16, device="cuda")
    table = torch.randperm(12)[:11]
    r = gpu.fetch(ids, out=PagedKV(pages, table))
    assert r.ok, r.error
    torch.testing.assert_close(PagedKV(pages, table).gather(0, len(ids)).cpu().float(), ref, atol=1e-3, rtol=0)


@pytest.mark.gpu
def test_a_bad_hevc_chunk_stops_a_driven_fetch_there_and_never_poisons_the_sessions(monkeypatch):
    """A chunk failing its checksum, then one whose video NVDEC cannot decode (its checksums pass):
    the driven fetch stops at that chunk with its error, what comes before is restored, and the
    next fetches restore what the CPU does."""
    import numpy as np

    from kvcodec.codecs.hevc import driven as hevc_driven
    from kvcodec.fetcher import blob_key
    from kvcodec.fetcher.policy import get_policy

    _nvdec()
    (cpu, gpu), ids, store = _caches(GPU_CFG, 600)
    gpu.policy = get_policy("fixed:0", GPU_CFG.resolutions)  # the blob damaged below is the one fetched
    ref = cpu.fetch(ids).kv.float()
    key = blob_key(gpu.keys(ids)[3], 0)
    blob = bytearray(store.get(key))
    blob[-100] ^= 0xFF  # inside the last stream: its checksum fails
    store.put(key, bytes(blob))
    r = gpu.fetch(ids)
    assert not r.ok and r.tokens_restored == 3 * 64 and "chunk" in str(r.error).lower(), r.error
    torch.testing.assert_close(r.kv[:, :, : 3 * 64].cpu().float(), ref[:, :, : 3 * 64], atol=1e-3, rtol=0)
    cpu.put(ids, _kv(len(ids)))  # the failed chunk's meta was dropped: coded again
    split = hevc_driven.split_streams

    def damaged(payload, entries, what, deferred=frozenset()):
        streams = split(payload, entries, what, deferred)
        if what == "chunk 3":  # past the checksums: garbage where its video is
            junk = np.random.default_rng(0).integers(0, 256, len(streams["video"]), dtype=np.uint8)
            streams = {**streams, "video": junk.tobytes()}
        return streams

    monkeypatch.setattr(hevc_driven, "split_streams", damaged)
    r = gpu.fetch(ids)
    assert not r.ok and r.tokens_restored == 3 * 64 and "chunk" in str(r.error).lower(), r.error
    monkeypatch.setattr(hevc_driven, "split_streams", split)
    cpu.put(ids, _kv(len(ids)))
    for _ in range(2):
        r = gpu.fetch(ids)
        assert r.ok, r.error
        torch.testing.assert_close(r.kv.cpu().float(), ref, atol=1e-3, rtol=0)


def test_a_split_chunk_is_staged_only_once_every_piece_is_pushed(monkeypatch):
    """A session drained to make room for a chunk's later pieces may complete its earlier ones
    during submit: the chunk waits for its last piece (it was staged with one buffer and failed)."""
    from kvcodec.video import nvcuvid_native

    monkeypatch.setattr(nvcuvid_native, "MAX_TARGETS", 4)  # one session's ring fills within the second chunk
    codec, kv, chunks, ref = _chunks(CodecConfig(**{**CFG.to_dict(), "streams_per_chunk": 3}))
    outs = [torch.full_like(r, float("nan")) for r in ref]
    driver = StageDriver(codec, [FakeDecoder(None)])
    got = _drive(driver, chunks, outs, driver.end_all)
    driver.close()
    driver.finish([got[i] for i in sorted(got)], [outs[i] for i in sorted(got)])
    for i in sorted(got):
        assert torch.equal(outs[i], ref[i]), i


def test_a_chunk_whose_preparation_fails_is_that_chunks_error_and_the_others_restore(monkeypatch):
    """Not a codec error (a GPU out of memory, say) while a chunk is prepared: that chunk comes back
    as a KVCodecError naming it; the session is not taken for failed, the other chunks restore."""
    from kvcodec.codecs.hevc import driven as hevc_driven
    from kvcodec.errors import KVCodecError

    prepare = hevc_driven.HevcDriven.prepare

    def failing(self, reading):  # noqa: ANN001, ANN202
        if reading.info.index == 0:
            raise RuntimeError("out of memory (a stand-in)")
        return prepare(self, reading)

    monkeypatch.setattr(hevc_driven.HevcDriven, "prepare", failing)
    codec, kv, chunks, ref = _chunks(CFG)
    outs = [torch.full_like(r, float("nan")) for r in ref]
    decoder = FakeDecoder(None)
    driver = StageDriver(codec, [decoder])
    got = _drive(driver, chunks, outs, driver.end_all)
    driver.close()
    assert isinstance(got[0], KVCodecError) and "chunk 0" in str(got[0]) and "out of memory" in str(got[0])
    ok = sorted(i for i in got if i != 0)
    driver.finish([got[i] for i in ok], [outs[i] for i in ok])
    assert all(torch.equal(outs[i], ref[i]) for i in ok) and decoder.decoded_alone == 0


def test_a_failed_session_waiting_to_decode_a_chunk_alone_takes_no_new_pieces():
    """A split chunk with pieces on a failed session is decoded alone with that session's decoder
    once its other pieces are out: until then no new piece goes to that session (its run would
    reopen on the decoder the chunk is decoded with)."""
    codec, kv, chunks, ref = _chunks(CFG)
    driver = StageDriver(codec, [FakeDecoder(None) for _ in range(3)])
    driver.reserved[0] = 1
    picked = {driver._run_for(144, 144) for _ in range(6)}
    assert 0 not in picked


def test_the_binding_check_sees_a_blob_before_it_is_read_against_the_target():
    """A blob of another prefix whose shape also differs from what the fetch expects: the fetch's
    binding check runs on its header first, so it is refused as a FormatError (the fetch drops
    such a chunk and the next put rewrites it), not as the target's ShapeError."""
    codec, kv, chunks, ref = _chunks(CFG)

    def check(tag, info):
        raise FormatError("bound to another prefix")

    driver = StageDriver(codec, [FakeDecoder(None)], check)
    driver.submit(0, chunks[0].blobs[0], torch.empty(4, 2, 64, 2, 32, dtype=torch.float16))
    ((tag, err, _),) = driver.poll()
    assert tag == 0 and type(err) is FormatError


ZSTD_CFG = CodecConfig(sample_coder="zstd", chunk_tokens=128, resolutions=((144, 144),), search_layout=False)


def _drive_host(driver, chunks, outs, blobs=None) -> dict:
    """Submit every chunk, then hand back each as its host work finishes (waited for, not polled in a race)."""
    for i, ch in enumerate(chunks):
        driver.submit(i, (blobs or {}).get(i, ch.blobs[0]), outs[i])
    got: dict = {}
    for i in range(len(chunks)):
        while driver.pending(i):
            driver.wait(i, 30.0, flush=False)
            got.update((tag, part) for tag, part, _ in driver.poll())
    got.update((tag, part) for tag, part, _ in driver.poll())
    return got


@pytest.mark.parametrize("streams", [1, 3])
def test_chunks_without_videos_are_decompressed_on_host_threads_and_restore_the_same(streams):
    codec, kv, chunks, ref = _chunks(CodecConfig(**{**ZSTD_CFG.to_dict(), "streams_per_chunk": streams}))
    outs = [torch.full_like(r, float("nan")) for r in ref]
    assert all(not driven_of(codec).read(ch.blobs[0], outs[i]).pieces for i, ch in enumerate(chunks))  # no videos
    driver = StageDriver(codec, [FakeDecoder(None) for _ in range(2)])
    got = _drive_host(driver, chunks, outs)
    driver.close()
    assert sorted(got) == list(range(len(chunks)))
    driver.finish([got[i] for i in sorted(got)], [outs[i] for i in sorted(got)])
    for i in sorted(got):
        assert torch.equal(outs[i], ref[i]), i


def _with_samples(blob: bytes, samples: bytes) -> bytes:
    """The chunk blob with its samples stream replaced (its size and checksum in the header made to match)."""
    h, payload = parse_chunk(blob)
    streams = dict(split_streams(payload, h.streams, "chunk"), samples=samples)
    entries = tuple(StreamEntry(e.name, e.codec, len(streams[e.name]), crc32(streams[e.name])) for e in h.streams)
    header = dataclasses.replace(h, streams=entries).to_json()
    return write_object(CHUNK_MAGIC, header, [bytes(streams[e.name]) for e in h.streams])


def test_a_chunk_whose_samples_do_not_decompress_is_refused_by_name_and_the_others_restore():
    codec, kv, chunks, ref = _chunks(ZSTD_CFG)
    outs = [torch.full_like(r, float("nan")) for r in ref]
    driver = StageDriver(codec, [FakeDecoder(None)])
    got = _drive_host(driver, chunks, outs, blobs={1: _with_samples(chunks[1].blobs[0], b"not zstd at all")})
    driver.close()
    assert isinstance(got[1], KVCodecError) and "chunk 1" in str(got[1]) and "samples" in str(got[1])
    good = [i for i in sorted(got) if i != 1]
    driver.finish([got[i] for i in good], [outs[i] for i in good])
    for i in good:
        assert torch.equal(outs[i], ref[i]), i


def test_samples_whose_checksum_fails_are_refused_on_the_host_thread_by_name():
    """The samples' checksum of a chunk without a video is verified where they are decompressed."""
    from kvcodec.errors import ChecksumError

    codec, kv, chunks, ref = _chunks(ZSTD_CFG)
    blob = bytearray(chunks[2].blobs[0])
    blob[-100] ^= 0x40  # inside the last stream: the samples
    h, _ = parse_chunk(bytes(blob))
    assert h.streams[-1].name == "samples"
    outs = [torch.full_like(r, float("nan")) for r in ref]
    driver = StageDriver(codec, [FakeDecoder(None)])
    for i, ch in enumerate(chunks):
        driver.submit(i, bytes(blob) if i == 2 else ch.blobs[0], outs[i])
    assert 2 in driver.on_host  # read without reading the samples
    got = {}
    for i in range(len(chunks)):
        while driver.pending(i):
            driver.wait(i, 30.0, flush=False)
            got.update((tag, part) for tag, part, _ in driver.poll())
    driver.close()
    assert isinstance(got[2], ChecksumError) and "chunk 2" in str(got[2]) and "samples" in str(got[2])
    assert torch.isnan(outs[2]).all()
    good = [i for i in sorted(got) if i != 2]
    driver.finish([got[i] for i in good], [outs[i] for i in good])
    assert all(torch.equal(outs[i], ref[i]) for i in good)


def test_the_host_pools_size_is_half_the_cores_unless_set_and_a_bad_setting_is_refused(monkeypatch):
    from kvcodec.codecs import driven
    from kvcodec.errors import ConfigError
    from kvcodec.fetcher import cache

    monkeypatch.delenv("KVCODEC_HOST_THREADS", raising=False)
    assert driven.host_threads() == driven.HOST_THREADS and 1 <= driven.HOST_THREADS <= 8
    monkeypatch.setenv("KVCODEC_HOST_THREADS", " 3 ")
    monkeypatch.setattr(driven, "_host_pool", None)  # a pool of this test's own, the process's left as it was
    assert driven.host_threads() == 3 and driven.host_pool()._max_workers == 3
    driven.host_pool().shutdown()
    for bad in ("0", "-2", "x", "1.5", "\u00b2", "257", "4294967296"):
        with pytest.raises(ConfigError, match="KVCODEC_HOST_THREADS"):
            driven.host_threads(bad)
    monkeypatch.setenv("KVCODEC_HOST_THREADS", "0")
    monkeypatch.setattr(cache, "_device", lambda device: torch.device("cuda"))  # a CUDA cache, made on any machine
    with pytest.raises(ConfigError, match="KVCODEC_HOST_THREADS"):
        cache.PrefixCache("memory://", "m", CodecConfig(), "cuda")


@pytest.mark.parametrize("fault", ["checksum", "stage"])
def test_a_chunk_refused_by_its_host_work_leaves_no_buffer_in_a_cycle(fault, monkeypatch):
    """An int8 chunk without videos whose samples fail their checksum on a host thread, or whose staging fails
    (a GPU out of memory, which the CPU cannot cause), is that chunk's error, and its target (a view of the
    fetch's output) and Future are left in no reference cycle: the error, raised where it was collected,
    held that frame (and the frames that called it), and the frame the Future and the list holding the error."""
    from kvcodec.codecs.hevc.driven import HevcDriven
    from synthetic import synthetic_kv
    from test_fetcher_codecs import cyclic_buffers

    codec = HevcCodec(CodecConfig(quant="int8", chunk_tokens=32, sample_coder="zstd"))
    kv = synthetic_kv(64, 3)
    (chunk, *_) = codec.encode_chunks(kv)
    blob = bytearray(chunk.blobs[0])
    if fault == "checksum":
        blob[-40] ^= 0xFF  # in its samples stream, checked on the host thread
    else:

        def out_of_memory(self, reading, buffers, target):  # noqa: ANN001, ANN202
            raise RuntimeError("CUDA out of memory")

        monkeypatch.setattr(HevcDriven, "stage", out_of_memory)
    errors = []

    def refused() -> None:
        driver = StageDriver(codec, [])
        out = torch.empty((*kv.shape[:2], 32, *kv.shape[3:]), dtype=torch.float16)
        driver.submit_many([(0, bytes(blob), out)])
        for future, *_ in driver.on_host.values():
            future.exception(60)
        errors.extend(str(e) for _, e, _ in driver.poll())  # the strings: the errors themselves hold frames
        driver.close()

    assert cyclic_buffers(refused) == []
    assert len(errors) == 1 and "chunk 0" in errors[0], errors
    assert ("samples" if fault == "checksum" else "RuntimeError: CUDA out of memory") in errors[0], errors
