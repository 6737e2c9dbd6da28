"""The nvcuvid backend: libnvcuvid through ctypes, in torch's own CUDA context.

Host side (runs everywhere): the ctypes structures match the Video Codec SDK's 64-bit layouts,
the surface copy plan covers every plane. GPU side (skipped without NVDEC): bit-exact frames
against the CPU decoder, session reuse, errors, and N threads restoring chunks in one context.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.errors import CorruptStreamError
from kvcodec.video import nvcuvid_api as api
from kvcodec.video.nvcuvid import NvcuvidDecoder, feed_plan, plane_copies, surface_layout
from kvcodec.video.nvdec import surface_to_planes

needs_nvcuvid = pytest.mark.skipif(not NvcuvidDecoder.is_available(), reason="needs a CUDA GPU with NVDEC")


# -- host side -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "struct,size",
    [
        (api.DecodeCaps, 88),
        (api.DecodeCreateInfo, 176),
        (api.ProcParams, 264),
        (api.VideoFormat, 64),
        (api.ParserDispInfo, 24),
        (api.SourceDataPacket, 32),
        (api.ParserParams, 136),
        (api.Memcpy2D, 128),
    ],
)
def test_struct_sizes_match_the_sdk(struct, size):
    assert ctypes.sizeof(struct) == size


@pytest.mark.parametrize(
    "struct,field,offset",
    [
        (api.DecodeCreateInfo, "display_area", 80),
        (api.DecodeCreateInfo, "OutputFormat", 88),
        (api.DecodeCreateInfo, "vidLock", 120),
        (api.DecodeCreateInfo, "enableHistogram", 136),
        (api.ProcParams, "output_stream", 56),
        (api.ProcParams, "histogram_dptr", 248),
        (api.ParserParams, "pUserData", 40),
        (api.ParserParams, "pfnDisplayPicture", 64),
        (api.ParserParams, "pExtVideoInfo", 128),
        (api.VideoFormat, "chroma_format", 40),
        (api.VideoFormat, "min_num_decode_surfaces", 15),
        (api.DecodeCaps, "bIsSupported", 24),
    ],
)
def test_struct_field_offsets(struct, field, offset):
    assert getattr(struct, field).offset == offset


def test_surface_layout_per_format():
    assert surface_layout(api.CHROMA_444, 8, 256, 144) == (api.SURFACE_YUV444, "YUV444", 256, 432)
    assert surface_layout(api.CHROMA_444, 10, 256, 144) == (api.SURFACE_YUV444_16BIT, "YUV444_16BIT", 512, 432)
    assert surface_layout(api.CHROMA_420, 8, 256, 144) == (api.SURFACE_NV12, "NV12", 256, 216)
    with pytest.raises(CorruptStreamError):
        surface_layout(0, 8, 256, 144)  # monochrome: NVDEC has no HEVC 4:0:0


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["YUV444", "NV12"]),
    half_height=st.integers(1, 40),
    odd=st.booleans(),
    width=st.integers(2, 24).map(lambda w: 2 * w),
    extra=st.integers(0, 16),
)
def test_plane_copies_rebuild_the_dense_surface(name, half_height, odd, width, extra):
    """Copying a synthetic mapped surface (planes every align2(height) rows, rows `pitch` apart)
    by the plan gives the dense buffer surface_to_planes reads back, plane for plane."""
    height = 2 * half_height - (1 if odd and name == "YUV444" else 0)
    pitch = width + extra
    aligned = (height + 1) & ~1
    rng = np.random.default_rng(height * 1000 + width)
    planes = [rng.integers(0, 256, (height, width), dtype=np.uint8) for _ in range(3)]
    surface = np.zeros((3 * aligned, pitch), dtype=np.uint8)
    if name == "YUV444":
        for k in range(3):
            surface[k * aligned : k * aligned + height, :width] = planes[k]
        rows = 3 * height
    else:
        planes = [planes[0], planes[1][: height // 2, : width // 2], planes[2][: height // 2, : width // 2]]
        surface[:height, :width] = planes[0]
        surface[aligned : aligned + height // 2, 0:width:2] = planes[1]
        surface[aligned : aligned + height // 2, 1:width:2] = planes[2]
        rows = height + height // 2
    flat = surface.reshape(-1)
    dense = np.zeros((rows, width), dtype=np.uint8)
    for offset, row, n in plane_copies(name, height, pitch):
        src = flat[offset : offset + n * pitch].reshape(n, pitch)[:, :width]
        dense[row : row + n] = src
    got = surface_to_planes(torch.from_numpy(dense), name, width, height)
    assert all(np.array_equal(g.numpy(), p) for g, p in zip(got, planes))


@given(size=st.integers(0, 5000), piece=st.integers(1, 700))
def test_feed_plan_covers_the_stream_in_order(size, piece):
    plan = feed_plan(size, piece)
    assert [off for off, _ in plan] == list(range(0, size, piece))
    assert sum(n for _, n in plan) == size and all(0 < n <= piece for _, n in plan)
    with pytest.raises(ValueError):
        feed_plan(size, 0)


def test_unavailable_without_a_gpu_is_a_clean_no():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert NvcuvidDecoder.is_available() is False


# -- GPU side ------------------------------------------------------------------------------------


def _frames(width: int, height: int, n: int, seed: int, spread: float = 20.0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.integers(40, 200, size=(3, height, 1))
    return [np.clip(base + rng.normal(0, spread, (3, height, width)), 0, 255).astype(np.uint8) for _ in range(n)]


def _encode(frames, width, height) -> bytes:
    from kvcodec.video.x265_cpu import X265Encoder

    return X265Encoder(threads=2).encode(frames, width, height)


@needs_nvcuvid
@pytest.mark.gpu
@pytest.mark.parametrize("delay", [0, 1, 3])
@pytest.mark.parametrize("width,height,n", [(144, 144, 4), (512, 256, 7), (1024, 1024, 3), (176, 400, 4)])
def test_bit_exact_frames(width, height, n, delay):
    src = _frames(width, height, n, seed=width + height)
    got = [
        f.cpu().numpy() for f in NvcuvidDecoder(display_delay=delay).decode(_encode(src, width, height), width, height)
    ]
    assert len(got) == n and all(np.array_equal(g, s) for g, s in zip(got, src))


@needs_nvcuvid
@pytest.mark.gpu
def test_frames_held_across_requests_need_copy():
    src = _frames(256, 256, 5, seed=11)
    got = list(NvcuvidDecoder(copy=True).decode(_encode(src, 256, 256), 256, 256))
    assert all(np.array_equal(g.cpu().numpy(), s) for g, s in zip(got, src))


@needs_nvcuvid
@pytest.mark.gpu
def test_session_reuse_resize_and_abandoned_stream():
    dec = NvcuvidDecoder()
    for k, (w, h) in enumerate([(256, 256), (256, 256), (512, 512), (256, 256)]):
        src = _frames(w, h, 3, seed=100 + k, spread=5.0 + 10 * k)
        got = [f.cpu().numpy() for f in dec.decode(_encode(src, w, h), w, h)]
        assert len(got) == 3 and all(np.array_equal(a, b) for a, b in zip(got, src))
    assert dec.sessions_created == 2
    it = dec.decode(_encode(_frames(256, 256, 5, seed=7), 256, 256), 256, 256)
    next(it)
    it.close()
    b = _frames(256, 256, 2, seed=8)
    assert all(np.array_equal(x.cpu().numpy(), y) for x, y in zip(dec.decode(_encode(b, 256, 256), 256, 256), b))


@needs_nvcuvid
@pytest.mark.gpu
@pytest.mark.parametrize("delay", [0, 1, 2])
def test_streams_back_to_back_come_out_exactly_each_under_its_key(delay):
    sizes = [(256, 256, 1), (256, 256, 3), (256, 256, 1), (144, 176, 2), (144, 176, 1), (256, 256, 1)]
    srcs = [_frames(w, h, n, seed=50 + k) for k, (w, h, n) in enumerate(sizes)]
    streams = [_encode(src, w, h) for src, (w, h, _) in zip(srcs, sizes)]
    dec = NvcuvidDecoder(display_delay=delay)
    items = [(f"s{k}", bs, w, h, n) for k, (bs, (w, h, n)) in enumerate(zip(streams, sizes))]
    items.insert(2, None)  # a pause: handed back as (None, None), nothing fed
    out = [(key, None if f is None else f.cpu().numpy()) for key, f in dec.decode_each(iter(items))]  # views: copy now
    assert sum(f is None for _, f in out) == 1
    got = [(key, f) for key, f in out if f is not None]
    want = [(f"s{k}", frame) for k, src in enumerate(srcs) for frame in src]
    assert [k for k, _ in got] == [k for k, _ in want]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, want))
    assert dec.sessions_created == 2  # one per size, reused when the size comes back


@needs_nvcuvid
@pytest.mark.gpu
@pytest.mark.parametrize("announced", [1, 3])
def test_a_stream_announcing_the_wrong_frame_count_raises(announced):
    a, b = _encode(_frames(256, 256, 2, seed=60), 256, 256), _encode(_frames(256, 256, 1, seed=61), 256, 256)
    dec = NvcuvidDecoder()
    with pytest.raises(CorruptStreamError):
        list(dec.decode_each(iter([("a", a, 256, 256, announced), ("b", b, 256, 256, 1)])))
    with pytest.raises(CorruptStreamError):
        list(dec.decode_each(iter([("b", b, 256, 256, 1), ("a", a, 256, 256, announced)])))
    assert [k for k, _ in dec.decode_each(iter([("a", a, 256, 256, 2), ("b", b, 256, 256, 1)]))] == ["a", "a", "b"]


@needs_nvcuvid
@pytest.mark.gpu
def test_wrong_size_and_garbage_raise():
    bs = _encode(_frames(256, 256, 2, seed=3), 256, 256)
    with pytest.raises(CorruptStreamError):
        list(NvcuvidDecoder().decode(bs, 512, 256))
    cut = bs[: len(bs) // 2] + bytes(64) + bs[len(bs) // 2 :]
    dec = NvcuvidDecoder()
    try:
        frames = [f.cpu().numpy() for f in dec.decode(cut, 256, 256)]
    except CorruptStreamError:
        frames = None
    assert frames is None or len(frames) <= 2  # never a crash, never extra frames
    assert len(list(dec.decode(bs, 256, 256))) == 2  # the decoder still works afterwards


@needs_nvcuvid
@pytest.mark.gpu
def test_threads_restore_chunks_exactly_in_one_context():
    import kvcodec
    from kvcodec.codecs.hevc.pool import restore_in_pool
    from kvcodec.video.nvcuvid_threads import NvcuvidThreads

    gen = torch.Generator().manual_seed(0)
    kv = (torch.randn((4, 2, 1024, 2, 64), generator=gen) * 0.5).to(torch.float16)
    config = kvcodec.CodecConfig(sample_coder="hevc", quant="int8", chunk_tokens=128, resolutions=((256, 256),))
    chunks = kvcodec.encode_chunks(kv, config)
    blobs = [c.blob_for((256, 256)) for c in chunks]
    ref = torch.empty_like(kv)
    for blob, (a, b) in zip(blobs, [(i * 128, (i + 1) * 128) for i in range(len(blobs))]):
        kvcodec.decode_chunk_blob(blob, "cpu", out=ref[:, :, a:b])
    out = torch.empty(kv.shape, dtype=kv.dtype, device="cuda")
    names = set()
    with NvcuvidThreads(sessions=2, threads=4) as dec:
        restore_in_pool(dec, blobs, [out[:, :, i * 128 : (i + 1) * 128] for i in range(len(blobs))])
        names = {t.name for t in threading.enumerate() if t.name.startswith("nvcuvid")}
        assert len(dec.decoders) == 2
        assert all(d.ctx == api.primary_context(0) for d in dec.decoders)
    assert names
    assert torch.equal(out.cpu(), ref)


@needs_nvcuvid
@pytest.mark.gpu
def test_threads_stand_where_an_nvdec_pool_does():
    import kvcodec
    from kvcodec.codecs.hevc.pool import restore_in_pool
    from kvcodec.video.nvcuvid_threads import NvcuvidThreads

    gen = torch.Generator().manual_seed(1)
    kv = (torch.randn((2, 2, 512, 2, 64), generator=gen) * 0.5).to(torch.float16)
    chunks = kvcodec.encode_chunks(
        kv, kvcodec.CodecConfig(sample_coder="hevc", quant="int4", chunk_tokens=128, resolutions=((256, 256),))
    )
    blobs = [c.blob_for((256, 256)) for c in chunks]
    ref = torch.empty_like(kv)
    outs = []
    out = torch.empty(kv.shape, dtype=kv.dtype, device="cuda")
    for i, blob in enumerate(blobs):
        kvcodec.decode_chunk_blob(blob, "cpu", out=ref[:, :, i * 128 : (i + 1) * 128])
        outs.append(out[:, :, i * 128 : (i + 1) * 128])
    with NvcuvidThreads(sessions=2) as dec:
        restore_in_pool(dec, blobs, outs)
        torch.cuda.synchronize()
    assert torch.equal(out.cpu(), ref)


@needs_nvcuvid
@pytest.mark.gpu
def test_split_chunks_restore_their_parts_on_several_sessions_exactly():
    import kvcodec
    from kvcodec.codecs import HevcCodec
    from kvcodec.restore.paged import PagedKV
    from kvcodec.video.nvcuvid_threads import NvcuvidThreads

    gen = torch.Generator().manual_seed(2)
    kv = (torch.randn((5, 2, 256, 2, 64), generator=gen) * 0.5).to(torch.float16)
    one = kvcodec.CodecConfig(sample_coder="hevc", quant="int8", chunk_tokens=128, resolutions=((256, 256),))
    split = kvcodec.CodecConfig(**{**one.to_dict(), "streams_per_chunk": 3})
    ref = kvcodec.decode(kvcodec.encode(kv, one))
    blobs = [c.blobs[0] for c in kvcodec.encode_chunks(kv, split)]
    out = torch.empty(kv.shape, dtype=kv.dtype, device="cuda")
    pages = torch.zeros((5, 2, 8, 64, 2, 64), dtype=kv.dtype, device="cuda")
    table = torch.tensor([6, 1, 4, 0], device="cuda")
    with NvcuvidThreads(sessions=3) as dec:
        codec = HevcCodec(split, pool=dec)
        for i, blob in enumerate(blobs):
            codec.decode_chunk(blob, out[:, :, i * 128 : (i + 1) * 128])
            codec.decode_chunk(blob, PagedKV(pages, table))
        torch.cuda.synchronize()
    assert torch.equal(out.cpu(), ref)
    assert torch.equal(PagedKV(pages, table).gather(0, 256).cpu(), ref)


@needs_nvcuvid
@pytest.mark.gpu
@pytest.mark.parametrize("delay", [0, 1, 2])
@pytest.mark.parametrize("loop", ["decode_each_into", "decode_each_fed"])
def test_native_callbacks_put_every_stream_exactly_in_its_buffer(delay, loop):
    """decode_each_into (C decode and display callbacks, nvcuvid_native) and decode_each_fed (the
    same, the parser fed by a native thread) against the frames the sources hold, several streams
    back to back, a change of size among them, odd heights."""
    import torch

    if not NvcuvidDecoder.native():
        pytest.skip("the native callbacks do not build here")
    sizes = [(256, 256, 1), (256, 256, 3), (144, 176, 2), (160, 145, 1), (256, 256, 2)]
    srcs = [_frames(w, h, n, seed=70 + k) for k, (w, h, n) in enumerate(sizes)]
    streams = [_encode(src, w, h) for src, (w, h, _) in zip(srcs, sizes)]
    bufs = [torch.full((n * 3 * w * h,), 7, dtype=torch.uint8, device="cuda") for w, h, n in sizes]
    dec = NvcuvidDecoder(display_delay=delay)
    each = getattr(dec, loop)
    items = [(k, bs, w, h, n, b.data_ptr()) for k, (bs, (w, h, n), b) in enumerate(zip(streams, sizes, bufs))]
    assert list(each(iter(items))) == list(range(len(sizes)))
    for src, buf in zip(srcs, bufs):
        assert np.array_equal(buf.cpu().numpy(), np.concatenate([f.reshape(-1) for f in src]))
    a, b = streams[1], streams[0]
    with pytest.raises(CorruptStreamError):  # a stream with more frames than it announces
        list(each(iter([("a", a, 256, 256, 1, bufs[1].data_ptr()), ("b", b, 256, 256, 1, bufs[0].data_ptr())])))
    with pytest.raises(CorruptStreamError):  # fewer
        list(each(iter([("b", b, 256, 256, 2, bufs[1].data_ptr())])))
    assert list(each(iter([("b", b, 256, 256, 1, bufs[0].data_ptr())]))) == ["b"]
