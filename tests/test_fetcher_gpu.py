"""PrefixCache.fetch onto a CUDA device (skipped without CUDA): raw chunks, and HEVC through NVDEC."""

from __future__ import annotations

import pytest
import torch

import test_transform_gpu as gpu_tests  # the synthetic transform (kvt fixture) and KV those tests code
from kvcodec.config import CodecConfig
from kvcodec.errors import BackendUnavailableError
from kvcodec.fetcher import DecodeProfile, PrefixCache
from kvcodec.fetcher.rawcodec import RawCodec

kvt = gpu_tests.kvt  # the module-scoped fixture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = CodecConfig(sample_coder="hevc", chunk_tokens=64, resolutions=((256, 256), (512, 512)), search_layout=False)


def make_kv(tokens=200, layers=4, heads=2, dim=64):
    g = torch.Generator().manual_seed(0)
    return torch.randn((layers, 2, tokens, heads, dim), generator=g).half()


@pytest.mark.parametrize("direct", [False, True])
def test_raw_fetch_onto_cuda(direct):
    cache = PrefixCache(
        "memory://",
        "m",
        CFG,
        "cuda",
        codec=RawCodec(("raw", "zstd")),
        direct=direct,
        profile=DecodeProfile.default(CFG.resolutions),
    )
    kv, ids = make_kv(), list(range(200))
    assert cache.put(ids, kv) == 4
    r = cache.fetch(ids)
    assert r.ok and r.kv.device.type == "cuda" and torch.equal(r.kv.cpu(), kv)
    out = torch.zeros((4, 2, 256, 2, 64), dtype=torch.float32, device="cuda")
    r = cache.fetch(ids, 150, out=out)
    assert r.ok and torch.equal(out[:, :, :150].cpu(), kv[:, :, :150].float())
    assert (out[:, :, 150:] == 0).all()
    cpu_out = torch.zeros((4, 2, 200, 2, 64), dtype=torch.float16)
    assert torch.equal(cache.fetch(ids, out=cpu_out).kv, kv)


def test_hevc_fetch_through_nvdec_matches_cpu():
    from kvcodec.video.registry import get_decoder

    try:
        get_decoder("cuda", fallback=False)
    except BackendUnavailableError as e:
        pytest.skip(f"no NVDEC decoder here: {e}")
    kv, ids = make_kv(), list(range(200))
    cpu = PrefixCache("memory://gpu-hevc", "m", CFG, "cpu", profile=DecodeProfile.default(CFG.resolutions))
    assert cpu.put(ids, kv) == 4
    ref = cpu.fetch(ids).kv
    for direct in (False, True):
        for pol in ("fixed:0", "fixed:1", "adaptive"):
            gpu = PrefixCache("memory://gpu-hevc", "m", CFG, "cuda", policy=pol, direct=direct)
            r = gpu.fetch(ids)
            assert r.ok, r.error
            assert r.kv.device.type == "cuda"
            assert torch.allclose(r.kv.cpu().float(), ref.float(), atol=1e-3, rtol=0), (pol, direct)


@pytest.mark.parametrize("streams_per_chunk", [1, 2])
def test_int8_fetch_of_zstd_samples_onto_cuda_matches_cpu(streams_per_chunk):
    """The int8 codec's chunks without videos (zstd'd samples, on the Python host pool) fetched
    onto CUDA by the driven restore: the CPU fetch's values; a chunk whose
    samples were damaged in the store is refused, the prefix before it kept (the fetch stops with the
    later chunks' host work in flight), and once the next put rewrote it the next fetch restores it all."""
    from kvcodec.fetcher import blob_key

    config = CodecConfig(sample_coder="zstd", chunk_tokens=64, streams_per_chunk=streams_per_chunk)
    kv, ids = make_kv(tokens=520), list(range(520))
    store = f"memory://gpu-int8-zstd-{streams_per_chunk}"
    cpu = PrefixCache(store, "m", config, "cpu", profile=DecodeProfile.default(config.resolutions))
    assert cpu.put(ids, kv) == 9
    ref = cpu.fetch(ids).kv
    gpu = PrefixCache(store, "m", config, "cuda", policy="fixed:0")
    r = gpu.fetch(ids)
    assert r.ok and r.kv.device.type == "cuda", r.error
    assert torch.allclose(r.kv.cpu().float(), ref.float(), atol=1e-3, rtol=0)
    key = blob_key(gpu.keys(ids)[1], 0)
    blob = bytearray(gpu.store.get(key))
    blob[-40] ^= 0xFF  # inside the last part's samples: its checksum fails
    gpu.store.put(key, bytes(blob))
    r = gpu.fetch(ids)
    assert not r.ok and r.tokens_restored == 64 and "chunk" in str(r.error).lower()
    assert torch.allclose(r.kv[:, :, :64].cpu().float(), ref[:, :, :64].float(), atol=1e-3, rtol=0)
    assert cpu.put(ids, kv) == 1  # the refused chunk was dropped: the next put rewrites it
    r = gpu.fetch(ids)
    assert r.ok and torch.allclose(r.kv.cpu().float(), ref.float(), atol=1e-3, rtol=0)


@pytest.mark.parametrize("codec_name", ["transform-zstd", "transform-hevc", "int8-zstd", "int8-hevc"])
def test_a_driven_cuda_fetch_leaves_no_cyclic_garbage(codec_name, kvt):
    """A successful driven CUDA fetch (the default path) of the transform and int8 codecs, samples zstd'd or
    through NVDEC, frees what it made by reference counting: a chunk's pinned buffers held in a reference
    cycle live until the collector's next full pass, and the pinned allocator meanwhile pins new ones
    (session 63's int8 host work, a Future holding a callback that held it, fetched 2.1-3.3x slower and cost
    a matmul beside it 36-50%: benchmarks/results/fetch-h100-s64-int8-native.md)."""
    from kvcodec.codecs import driven, zstd_native
    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.video.registry import get_decoder
    from test_fetcher_codecs import cyclic_buffers

    kind, coder = codec_name.split("-")
    if not driven.DRIVEN:
        pytest.skip("KVCODEC_DRIVEN=0: no driven fetch")
    if coder == "hevc":
        try:
            get_decoder("cuda", fallback=False)
        except BackendUnavailableError as e:
            pytest.skip(f"no NVDEC decoder here: {e}")
    if kind == "transform" and coder == "zstd" and zstd_native.threads(driven.host_threads) is None:
        pytest.skip("no native zstd threads here (the transform's zstd'd samples would take the Python pool)")
    if kind == "transform":
        codec = TransformCodec(kvt[0], chunk_tokens=64, target_ratio=4.0, coder=coder)
    else:
        codec = CodecConfig(sample_coder=coder, chunk_tokens=64, streams_per_chunk=2)
    kv, ids = gpu_tests.synthetic_kv(520, 23).half(), list(range(9000, 9520))
    store = f"memory://gpu-cycles-{codec_name}"
    PrefixCache(store, "m", codec, "cpu").put(ids, kv)
    gpu = PrefixCache(store, "m", codec, "cuda", policy="fixed:0")
    assert gpu.fetch(ids).ok  # first use: threads, sessions, compiled kernels made and kept

    def fetches() -> None:
        for _ in range(3):
            r = gpu.fetch(ids)
            assert r.ok, r.error

    assert cyclic_buffers(fetches) == []


def test_cuda_without_a_gpu_decoder_decodes_on_the_cpu_and_says_so():
    """The README's promise: a CUDA device whose GPU decoder is unavailable decodes on the CPU
    (frames moved to the device) instead of failing every fetch; the result names the decoder."""
    from kvcodec.codecs.hevc.codec import HevcCodec
    from kvcodec.video.registry import get_decoder
    from kvcodec.video.x265_cpu import FFmpegHevcDecoder

    kv, ids = make_kv(), list(range(200))
    cpu = PrefixCache("memory://gpu-fallback", "m", CFG, "cpu", profile=DecodeProfile.default(CFG.resolutions))
    cpu.put(ids, kv)
    ref = cpu.fetch(ids).kv
    try:
        expected = get_decoder("cuda", fallback=False).name
    except BackendUnavailableError:
        expected = "ffmpeg-cpu"
    auto = PrefixCache("memory://gpu-fallback", "m", CFG, "cuda", policy="fixed:0")
    r = auto.fetch(ids)
    assert r.ok and r.stats.decoder == expected and torch.equal(r.kv.cpu(), ref), (r.error, r.stats.decoder)
    forced = PrefixCache(
        "memory://gpu-fallback", "m", HevcCodec(CFG, decoder=FFmpegHevcDecoder()), "cuda", policy="fixed:0"
    )
    r = forced.fetch(ids)
    assert r.ok and r.stats.decoder == "ffmpeg-cpu" and r.kv.device.type == "cuda" and torch.equal(r.kv.cpu(), ref)


def test_fetch_through_pool_workers_matches_cpu():
    from kvcodec.codecs.hevc.codec import HevcCodec
    from kvcodec.codecs.hevc.pool import open_pool
    from kvcodec.video.nvdec import NvdecDecoder

    if not NvdecDecoder.is_available():
        pytest.skip("no NVDEC decoder here")
    kv, ids = make_kv(), list(range(200))
    cpu = PrefixCache("memory://gpu-pool", "m", CFG, "cpu", profile=DecodeProfile.default(CFG.resolutions))
    assert cpu.put(ids, kv) == 4
    ref = cpu.fetch(ids).kv
    with open_pool(workers=2, slots=2, max_frame=(512, 512)) as pool:
        for direct in (False, True):
            gpu = PrefixCache(
                "memory://gpu-pool",
                "m",
                HevcCodec(CFG, pool=pool),
                "cuda",
                decode_workers=2,
                direct=direct,
                policy="fixed:1",
            )
            assert gpu.lookup(ids) == 200  # same keys as the plain codec wrote
            r = gpu.fetch(ids)
            assert r.ok, r.error
            assert torch.equal(r.kv.cpu(), ref)


def skip_without_nvdec() -> None:
    from kvcodec.video.nvcuvid import NvcuvidDecoder

    if not NvcuvidDecoder.is_available():
        pytest.skip("needs NVDEC")


def _transform_caches(kvt, tokens: int = 600, coder: str = "hevc", chunk: int = 64, res=(256, 256)):
    """A CPU and a CUDA PrefixCache over one memory store holding `tokens` of synthetic KV coded by
    the transform codec (HEVC samples: NVDEC on CUDA; mixed: odd chunks zstd, the host's threads),
    and the token ids."""
    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.store import open_store

    codec = TransformCodec(
        kvt[0], chunk_tokens=chunk, target_ratio=4.0, coder=coder, resolutions=(res,)
    )  # NVDEC: >= 144
    store, ids = open_store("memory://"), list(range(tokens))
    caches = [
        PrefixCache(store, "m", codec, dev, profile=DecodeProfile.default(codec.resolutions)) for dev in ("cpu", "cuda")
    ]
    assert caches[0].put(ids, gpu_tests.synthetic_kv(tokens, 21).half()) == -(-tokens // chunk)
    return caches, ids, store


def test_a_short_cuda_fetch_decodes_each_chunk_in_pieces_on_several_sessions(kvt, monkeypatch):
    """Two chunks of several frames each (every frame a stream that decodes alone): the driven fetch
    cuts each video into pieces (driven.split_for) on several NVDEC sessions, into one buffer per
    chunk, and restores what the CPU does."""
    from kvcodec.codecs import driven

    skip_without_nvdec()
    (cpu, gpu), ids, _ = _transform_caches(kvt, tokens=2048, chunk=1024, res=(160, 160))
    pushed, push = [], driven.StageDriver._push
    monkeypatch.setattr(
        driven.StageDriver,
        "_push",
        lambda self, tag, reading, *a: (pushed.append(len(reading.pieces)), push(self, tag, reading, *a))[1],
    )
    ref = cpu.fetch(ids)
    for _ in range(2):  # the second fetch reuses the sessions
        r = gpu.fetch(ids)
        assert r.ok, r.error
        torch.testing.assert_close(r.kv.cpu().float(), ref.kv.float(), atol=2**-12, rtol=2**-10)
    assert len(pushed) == 4 and min(pushed) > 1


@pytest.mark.parametrize("coder", ["hevc", "mixed"])
@pytest.mark.parametrize("driven", [True, False])
def test_transform_fetch_on_cuda_matches_the_cpu_fetch(kvt, driven, coder, monkeypatch):
    """The default staged fetch on CUDA: the caller's thread drives every NVDEC session
    (driven.StageDriver; driven False: decode worker threads); both restore what the CPU does."""
    import threading

    from kvcodec.codecs import driven as driven_module

    skip_without_nvdec()
    monkeypatch.setattr(driven_module, "DRIVEN", driven)
    (cpu, gpu), ids, _ = _transform_caches(kvt, coder=coder)
    ref = cpu.fetch(ids)
    for _ in range(2):  # the second fetch reuses the sessions
        r = gpu.fetch(ids)
        assert r.ok, r.error
        torch.testing.assert_close(r.kv.cpu().float(), ref.kv.float(), atol=2**-12, rtol=2**-10)
    workers = {t.worker for t in r.stats.timeline}
    assert (workers == {threading.current_thread().name}) == driven


def test_a_driven_fetch_takes_over_the_zstd_work_its_network_stage_began(kvt, monkeypatch):
    """A driven CUDA fetch of zstd'd transform chunks: the network stage begins each blob's zstd as it
    comes in (StageDriver.begin) and the fetch's thread takes that work over (a fetch's first blobs may come
    before its driver is made: at least one is taken over); it restores what the CPU does."""
    from kvcodec.codecs import driven, zstd_native

    if not torch.cuda.is_available() or not driven.DRIVEN:
        pytest.skip("needs CUDA and the driven fetch")
    if zstd_native.threads(driven.host_threads) is None:
        pytest.skip("no native zstd threads here")
    (cpu, gpu), ids, _ = _transform_caches(kvt, coder="zstd")
    ref = cpu.fetch(ids)
    assert gpu.fetch(ids).ok  # the level's plan is built by the fetch's thread
    taken, claim = [], driven.StageDriver._claim
    monkeypatch.setattr(driven.StageDriver, "_claim", lambda self, blob: taken.append(f := claim(self, blob)) or f)
    r = gpu.fetch(ids)
    assert r.ok, r.error
    torch.testing.assert_close(r.kv.cpu().float(), ref.kv.float(), atol=2**-12, rtol=2**-10)
    assert len(taken) == -(-len(ids) // 64) and any(f is not None for f in taken)


@pytest.mark.parametrize("driven", [True, False])
def test_a_cuda_fetch_output_is_freed_once_the_caller_drops_it(kvt, driven, monkeypatch):
    """No reference cycle holds a fetch (and its output on the GPU) until the garbage collector
    runs: the driver held the pipeline's check while the pipeline held the driver's finish."""
    from kvcodec.codecs import driven as driven_module
    from test_fetcher_codecs import output_freed_without_gc

    skip_without_nvdec()
    monkeypatch.setattr(driven_module, "DRIVEN", driven)
    (_, gpu), ids, _ = _transform_caches(kvt, coder="mixed")
    assert output_freed_without_gc(gpu, ids)


@pytest.mark.parametrize("driven", [True, False])
def test_repeated_cuda_fetches_reuse_the_memory_they_freed(kvt, driven, monkeypatch):
    """Fetches from one thread restore on that thread's kept stream: what one fetch freed (its
    output, its scratch) serves the next, instead of staying reserved for a stream of its own."""
    from kvcodec.codecs import driven as driven_module

    skip_without_nvdec()
    monkeypatch.setattr(driven_module, "DRIVEN", driven)
    (_, gpu), ids, _ = _transform_caches(kvt, coder="mixed")
    reserved = []
    for _ in range(6):
        r = gpu.fetch(ids)
        assert r.ok, r.error
        del r
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[-1] == reserved[2], reserved


def test_a_cuda_fetch_output_belongs_to_the_callers_stream(kvt):
    """The output's memory is the caller's stream's: once dropped, it is handed out again in the
    order of the caller's work, never to the next fetch while the caller's work may read it."""

    skip_without_nvdec()
    (_, gpu), ids, _ = _transform_caches(kvt, coder="mixed")
    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        r = gpu.fetch(ids)
    assert r.ok, r.error
    ptr = r.kv.data_ptr()
    owner = [
        seg["stream"]
        for seg in torch.cuda.memory_snapshot()
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]
    ]
    assert owner == [caller.cuda_stream]


@pytest.mark.parametrize("coder", ["hevc", "mixed"])
def test_a_damaged_chunk_stops_a_driven_fetch_there(kvt, coder):
    from kvcodec.fetcher import blob_key

    skip_without_nvdec()
    (cpu, gpu), ids, store = _transform_caches(kvt, coder=coder)
    key = blob_key(gpu.keys(ids)[3], 0)
    blob = bytearray(store.get(key))
    blob[-100] ^= 0xFF  # inside the last stream (the video; mixed: chunk 3's zstd samples): its checksum fails
    store.put(key, bytes(blob))
    r = gpu.fetch(ids)
    assert not r.ok and r.tokens_restored == 3 * 64 and "chunk" in str(r.error).lower()
    ref = cpu.fetch(ids, 3 * 64)
    torch.testing.assert_close(r.kv[:, :, : 3 * 64].cpu().float(), ref.kv.float(), atol=2**-12, rtol=2**-10)


def test_a_bad_chunk_never_poisons_the_kept_sessions(kvt, monkeypatch):
    """The driven fetch's runs (parser, feeder thread) stay open across fetches, each parser taking
    the next fetch's streams after its end-of-stream flush (nvcuvid_native.KEEP); a chunk whose
    video NVDEC cannot decode (its checksum passes) stops the fetch there with the chunk's error,
    and the next fetches restore what the CPU does."""
    import numpy as np

    from kvcodec.codecs.hevc.decode import idle_decoders
    from kvcodec.fetcher import blob_key
    from kvcodec.video import nvcuvid_native
    from kvcodec.video.nvcuvid import NvcuvidDecoder

    if not (NvcuvidDecoder.is_available() and nvcuvid_native.available()):
        pytest.skip("needs NVDEC and the native feeder")
    monkeypatch.setattr(nvcuvid_native, "KEEP", True)
    (cpu, gpu), ids, store = _transform_caches(kvt)
    ref = cpu.fetch(ids)

    def kept() -> list:
        return [d._kept for ds in idle_decoders._idle.values() for d in ds if getattr(d, "_kept", None)]

    def check(r) -> None:
        assert r.ok, r.error
        torch.testing.assert_close(r.kv.cpu().float(), ref.kv.float(), atol=2**-12, rtol=2**-10)

    check(gpu.fetch(ids))
    runs = kept()
    assert runs and all(r.feeder is not None and not r.busy for r in runs)  # open, idle
    check(gpu.fetch(ids))  # through the parsers flushed by the first fetch
    assert {id(r) for r in kept()} >= {id(r) for r in runs}
    bad = store.get(blob_key(gpu.keys(ids)[3], 0))
    read = gpu.codec._read_entries

    def damaged(blob, deferred=frozenset()):
        h, entries, streams = read(blob, deferred)
        if blob == bad:  # past the checksums: garbage where its video is
            junk = np.random.default_rng(0).integers(0, 256, len(streams["video"]), dtype=np.uint8)
            streams = {**streams, "video": junk.tobytes()}
        return h, entries, streams

    monkeypatch.setattr(gpu.codec, "_read_entries", damaged)
    r = gpu.fetch(ids)
    assert not r.ok and r.tokens_restored == 3 * 64 and "chunk" in str(r.error).lower(), r.error
    monkeypatch.setattr(gpu.codec, "_read_entries", read)
    assert all(not r.busy for r in kept())
    cpu.put(ids, gpu_tests.synthetic_kv(len(ids), 21).half())  # the failed chunk's meta was dropped
    ref = cpu.fetch(ids)  # chunk 3 coded again
    for _ in range(2):
        check(gpu.fetch(ids))


def test_restore_streams_take_the_configured_priority(monkeypatch):
    """A fetch's CUDA work runs on streams of streams.PRIORITY: the default one unless a benchmark
    (fetch_restore's -hipri) asks for the device's highest, which torch clamps HIGHEST to."""
    from kvcodec.fetcher.pipeline import _own_stream
    from kvcodec.video import streams
    from kvcodec.video.nvcuvid import NvcuvidDecoder

    with _own_stream(torch.device("cuda"), None):
        assert torch.cuda.current_stream().priority == 0
    _, highest = torch.cuda.Stream.priority_range()
    monkeypatch.setattr(streams, "PRIORITY", streams.HIGHEST)
    with _own_stream(torch.device("cuda"), None):
        assert torch.cuda.current_stream().priority == highest < 0
    try:
        decoder = NvcuvidDecoder("cuda")
    except BackendUnavailableError as e:
        pytest.skip(f"no NVDEC here: {e}")
    assert decoder.stream.priority == highest


_FIRST_FETCH = """
import sys, torch
from kvcodec.codecs.transform.codec import TransformCodec
from kvcodec.fetcher import DecodeProfile, PrefixCache
codec = TransformCodec(sys.argv[1], chunk_tokens=64, target_ratio=8.0, coder="zstd", resolutions=((256, 256),))
cache = PrefixCache(sys.argv[2], "m", codec, "cuda", profile=DecodeProfile.default(codec.resolutions))
ids = list(range(600))
if sys.argv[3] == "warm":
    cache.warm_up(torch.float16, tokens=len(ids))
before = torch.cuda.host_memory_stats()["allocated_bytes.current"]
r = cache.fetch(ids)
assert r.ok, r.error
print(torch.cuda.host_memory_stats()["allocated_bytes.current"] - before, codec.pinned_block_bytes())
"""


def test_a_warmed_up_cache_pins_nothing_for_its_first_fetchs_samples(kvt, tmp_path):
    """In a fresh process (torch's pinned cache empty): the first driven fetch of zstd'd transform
    chunks pins a staging block per chunk in flight, unless PrefixCache.warm_up made them. At 8x
    these chunks' samples fill under a quarter of the block (and the last chunk's less): only
    blocks of the one staging size come from the warm-up's."""
    import os
    import subprocess
    import sys

    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.store import open_store

    codec = TransformCodec(kvt[0], chunk_tokens=64, target_ratio=8.0, coder="zstd", resolutions=((256, 256),))
    url = f"file://{tmp_path}"
    ids = list(range(600))
    assert PrefixCache(open_store(url), "m", codec, "cpu").put(ids, gpu_tests.synthetic_kv(600, 21).half()) == 10
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    grew = {}
    for mode in ("cold", "warm"):
        run = subprocess.run(
            [sys.executable, "-c", _FIRST_FETCH, str(kvt[0]), url, mode], capture_output=True, text=True, env=env
        )
        assert run.returncode == 0, run.stderr[-2000:]
        grew[mode], block = (int(v) for v in run.stdout.split()[-2:])
    assert grew["cold"] >= block > grew["warm"], (grew, block)
