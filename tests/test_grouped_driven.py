"""GroupedDriven (codecs/grouped_driven.py): grouped chunks of the transform codec through driven.StageDriver,
as a fetch on CUDA drives them, restore what GroupedCodec.decode_chunk restores; a damaged or exchanged part
is that chunk's error."""

from __future__ import annotations

import pytest
import torch

import test_transform_gpu as gpu_tests  # the synthetic transform and KV those tests code
from kvcodec.codecs import make_codec, zstd_native
from kvcodec.codecs.driven import StageDriver, host_threads
from kvcodec.codecs.grouped import MAGIC, GroupedCodec
from kvcodec.codecs.grouped_driven import GroupedDriven
from kvcodec.codecs.transform.codec import TransformCodec
from kvcodec.container.format import read_object, write_object
from kvcodec.errors import KVCodecError
from kvcodec.kvspec import GroupedKV, KVSpec, LayerSpec

kvt = gpu_tests.kvt  # the module-scoped fixture
L, H, D = gpu_tests.L, gpu_tests.H, gpu_tests.D
KEEP, CT, TOKENS = 40, 64, 200
SPEC = KVSpec(
    tuple(LayerSpec("sliding", (H, D), (H, D), keep=KEEP) for _ in range(L))
    + tuple(LayerSpec("full", (H, D), (H, D)) for _ in range(L)),
    "float16",
)


def _kv() -> GroupedKV:
    kv = GroupedKV.empty(SPEC, TOKENS, window=False)
    for seed, t in enumerate(kv.tensors, 31):
        t.copy_(gpu_tests.synthetic_kv(TOKENS, seed))
    return kv


def _codec(kvt, **kw) -> GroupedCodec:
    return GroupedCodec(TransformCodec(kvt[0], chunk_tokens=CT, theta=1e-3, coder="zstd", **kw))  # one level: one plan


def _targets(chunks, window: bool = False) -> tuple[GroupedKV, list[GroupedKV]]:
    """The prefix's KV and each chunk's target in it; window: the last chunk's target holds only the sliding
    group's last KEEP positions (its part restores whole, then narrowed)."""
    out = GroupedKV.empty(SPEC, TOKENS, window=False)
    for t in out.tensors:
        t.fill_(float("nan"))
    targets = [out.view(ch.start_token, ch.start_token + ch.tokens) for ch in chunks]
    if window:
        last = chunks[-1]
        targets[-1] = GroupedKV.empty(SPEC, last.start_token + last.tokens, start=last.start_token, window=True)
    return out, targets


def _drive(driver: StageDriver, blobs, targets, begin: bool = False) -> dict:
    if begin:
        _drive(StageDriver(driver.chunks, []), blobs, targets)  # a first fetch builds the levels' plans
        for blob in blobs:
            driver.begin(blob)
        if zstd_native.threads(host_threads) is not None:
            assert len(driver.begun) == len(blobs)  # every chunk's host work begun as its blob came
    driver.submit_many([(i, blob, target) for i, (blob, target) in enumerate(zip(blobs, targets))])
    got: dict = {}
    for i in range(len(blobs)):
        while driver.pending(i):
            driver.wait(i, 30.0, flush=False)  # until its host work is done: no race with the pool
            got.update((tag, part) for tag, part, _ in driver.poll())
    got.update((tag, part) for tag, part, _ in driver.poll())
    return got


@pytest.mark.parametrize("begin", [False, True], ids=["read", "begun"])
@pytest.mark.parametrize("window", [False, True], ids=["whole-positions", "window"])
def test_driven_grouped_chunks_restore_what_decode_chunk_restores(kvt, begin, window):
    codec = _codec(kvt)
    assert codec.stages and not codec.codes_video
    driven = codec.driven_chunks()
    assert isinstance(driven, GroupedDriven)
    kv = _kv()
    chunks = codec.encode_chunks(kv)
    blobs = [ch.blobs[0] for ch in chunks]
    want, want_targets = _targets(chunks, window)
    for blob, target in zip(blobs, want_targets):
        codec.decode_chunk(blob, target)
    out, targets = _targets(chunks, window)
    driver = StageDriver(driven, [])
    got = _drive(driver, blobs, targets, begin)
    driver.close()
    assert sorted(got) == list(range(len(blobs))) and not any(isinstance(p, Exception) for p in got.values())
    driver.finish([got[i] for i in range(len(blobs))], targets)
    restored = chunks[-1].start_token if window else TOKENS  # the last chunk's own target holds the rest
    for a, b in zip(out.tensors, want.tensors):
        assert gpu_tests.within_an_ulp(a[:, :, :restored], b[:, :, :restored])
    for a, b in zip(targets[-1].tensors, want_targets[-1].tensors):
        assert gpu_tests.within_an_ulp(a, b)


def _exchanged(blob: bytes) -> bytes:
    """The blob with its two same-shape groups' parts listed under each other's group (sizes, checksums and the
    chunk's header otherwise consistent): each part's own key still names the group it was coded for."""
    header, payload = read_object(blob, MAGIC, "grouped chunk")
    a, b = header["parts"]
    a["group"], b["group"] = b["group"], a["group"]
    return write_object(MAGIC, header, [bytes(payload)])


@pytest.mark.parametrize("begin", [False, True], ids=["read", "begun"])
def test_a_damaged_part_is_that_chunks_error_and_the_others_restore(kvt, begin):
    codec = _codec(kvt)
    kv = _kv()
    chunks = codec.encode_chunks(kv)
    blobs = [ch.blobs[0] for ch in chunks]
    damaged = bytearray(blobs[1])
    damaged[-5] ^= 0x10  # inside the last group's part
    blobs[1] = bytes(damaged)
    out, targets = _targets(chunks)
    driver = StageDriver(codec.driven_chunks(), [])
    got = _drive(driver, blobs, targets, begin)
    driver.close()
    assert isinstance(got[1], KVCodecError)
    assert not any(isinstance(got[i], Exception) for i in (0, 2, 3))


@pytest.mark.parametrize("begin", [False, True], ids=["read", "begun"])
def test_parts_listed_under_each_others_group_are_that_chunks_error(kvt, begin):
    """Two same-shape groups' parts exchanged in a chunk's listing: refused by the part keys (read, and adopt of a
    chunk begun as its blob came in), so the fetch never restores one group's KV into the other."""
    codec = _codec(kvt)
    chunks = codec.encode_chunks(_kv())
    blobs = [ch.blobs[0] for ch in chunks]
    blobs[2] = _exchanged(blobs[2])
    _, targets = _targets(chunks)
    driver = StageDriver(codec.driven_chunks(), [])
    got = _drive(driver, blobs, targets, begin)
    driver.close()
    assert isinstance(got[2], KVCodecError) and "exchanged" in str(got[2])
    assert not any(isinstance(got[i], Exception) for i in (0, 1, 3))


def test_a_group_codec_that_cannot_be_driven_leaves_the_grouped_codec_undriven():
    assert GroupedCodec(make_codec("raw", chunk_tokens=CT)).driven_chunks() is None


def test_a_cuda_fetch_of_a_grouped_transform_is_driven(kvt):
    from kvcodec.codecs import driven

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with driven.stage_driver(_codec(kvt), "cuda", 7) as driver:
        assert driver is not None and isinstance(driver.chunks, GroupedDriven) and driver.runs == []


@pytest.mark.parametrize("kind", ["transform", "hevc"])
def test_a_cuda_grouped_fetch_restores_what_the_cpu_fetch_restores(kvt, kind):
    """GroupedPrefixCache on CUDA (driven by default) against the CPU fetch, to the end and to a target that the
    last chunk fetched reaches past (its fitting positions copied by the finish)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kvcodec.fetcher.grouped import GroupedPrefixCache
    from kvcodec.store import open_store

    codec = _codec(kvt) if kind == "transform" else GroupedCodec(make_codec("hevc", chunk_tokens=CT))
    store, ids = open_store("memory://"), list(range(500, 500 + TOKENS))
    GroupedPrefixCache(store, "m", codec, spec=SPEC).put(ids, _kv())
    for n in (TOKENS, 150):  # 150: the chunk of positions 128..191 reaches past the target
        cpu = GroupedPrefixCache(store, "m", codec, "cpu", spec=SPEC).fetch(ids, n)
        gpu = GroupedPrefixCache(store, "m", codec, "cuda", spec=SPEC).fetch(ids, n)
        assert cpu.ok and gpu.ok and cpu.tokens_restored == gpu.tokens_restored == n, (cpu.error, gpu.error)
        for a, b in zip(gpu.kv.tensors, cpu.kv.tensors):
            assert gpu_tests.within_an_ulp(a.cpu(), b) if kind == "transform" else torch.equal(a.cpu(), b)


def test_a_chunk_holding_no_part_the_target_needs_is_handed_back_on_either_path(kvt):
    """A chunk before every group's window holds no part: read or begun, it is handed back (nothing to restore),
    never left pending (a joined Future of no parts once never completed, and the driver's close then hung)."""
    spec = KVSpec(tuple(LayerSpec("sliding", (H, D), (H, D), keep=KEEP) for _ in range(L)), "float16")
    kv = GroupedKV.empty(spec, TOKENS, window=True)
    kv.tensors[0].copy_(gpu_tests.synthetic_kv(TOKENS, 3)[:, :, -KEEP:])
    codec = _codec(kvt)
    first = codec.encode_chunks(kv)[0].blobs[0]
    target = GroupedKV.empty(spec, CT, start=CT, window=False)  # holds none of the chunk's positions
    driver = StageDriver(codec.driven_chunks(), [])
    got = _drive(driver, [first, first], [target, target], begin=False)
    driver.begin(first)
    driver.submit(2, first, target)
    while driver.pending(2):
        driver.wait(2, 30.0, flush=False)
        got.update((tag, part) for tag, part, _ in driver.poll())
    driver.close()
    assert sorted(got) == [0, 1, 2] and not any(isinstance(p, Exception) for p in got.values())


def test_joined_host_work_holds_no_cycle_that_keeps_the_parts_buffers():
    """The Future joining a chunk's parts' host work lets go of the parts' Futures once joined: they (and the
    pinned samples their results hold) are freed when the fetch drops them, without the garbage collector."""
    import gc
    import weakref
    from concurrent.futures import Future

    from kvcodec.codecs.driven import Reading
    from kvcodec.codecs.grouped_driven import _Chunk, _joined

    parts = {0: Future(), 1: Future()}
    reading = Reading(None, (), _Chunk({}, {0: None, 1: None}))
    gc.disable()
    try:
        joined = _joined(reading, parts)
        for g, f in parts.items():
            f.set_result(f"prepared {g}")
        assert joined.result().state.subs == {0: "prepared 0", 1: "prepared 1"}
        held = [weakref.ref(f) for f in parts.values()]
        del parts, f, joined
        assert all(ref() is None for ref in held)
    finally:
        gc.enable()


def test_zstd_coded_groups_need_no_nvdec_session():
    """A grouped codec whose every group's chunks hold no video (HEVC codec with zstd samples) is driven without
    borrowing NVDEC sessions; the default HEVC codec may code video."""
    zstd = GroupedCodec(make_codec("hevc", chunk_tokens=CT, sample_coder="zstd"))
    assert not zstd.codes_video and GroupedCodec(make_codec("hevc", chunk_tokens=CT)).codes_video


def test_a_video_chunks_parts_without_video_are_prepared_while_it_decodes(kvt):
    """Sliding layers coded as video (NVDEC in a fetch; FFmpeg stands in here), full layers as zstd'd samples: the
    chunk's prepare (run while NVDEC decodes its frames) decompresses the zstd part, which stage then takes; the
    chunks restore what decode_chunk restores."""
    from test_transform_batch import FakeDecoder

    res = ((64, 64),)
    video = TransformCodec(kvt[0], chunk_tokens=CT, theta=1e-3, coder="hevc", resolutions=res)
    codec = GroupedCodec(_codec(kvt, resolutions=res).inner, per_group={"sliding": video})
    assert codec.codes_video
    chunks = codec.encode_chunks(_kv())
    blobs = [ch.blobs[0] for ch in chunks]
    want, want_targets = _targets(chunks)
    for blob, target in zip(blobs, want_targets):
        codec.decode_chunk(blob, target)
    out, targets = _targets(chunks)
    driven = codec.driven_chunks()
    first = driven.read(blobs[0], targets[0])
    prepared = driven.prepare(first)
    assert first.pieces and prepared.state.subs[0] is first.state.subs[0]  # the video part: nothing to prepare
    assert prepared.state.subs[1] is not first.state.subs[1]  # the zstd part: decompressed
    driver = StageDriver(driven, [FakeDecoder()])
    driver.submit_many([(i, blob, target) for i, (blob, target) in enumerate(zip(blobs, targets))])
    got: dict = {}
    while len(got) < len(blobs):
        driver.flush_stuck()
        got.update((tag, part) for tag, part, _ in driver.poll())
    driver.close()
    assert not any(isinstance(p, Exception) for p in got.values()), got
    driver.finish([got[i] for i in range(len(blobs))], targets)
    for a, b in zip(out.tensors, want.tensors):
        assert gpu_tests.within_an_ulp(a, b)
