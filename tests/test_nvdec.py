"""NVDEC backend: bit-exact against FFmpeg's CPU decoder on real x265 lossless streams.

The GPU tests need a CUDA GPU with NVDEC and PyNvVideoCodec; they skip cleanly elsewhere (CI). The
host-side pieces (access-unit splitting, surface layouts) are tested everywhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.errors import CorruptStreamError
from kvcodec.video.nvdec import NvdecDecoder, split_access_units, surface_to_planes
from kvcodec.video.x265_cpu import FFmpegHevcDecoder, X265Encoder

needs_nvdec = pytest.mark.skipif(
    not NvdecDecoder.is_available(), reason="needs a CUDA GPU with NVDEC and PyNvVideoCodec"
)


def _frames(width: int, height: int, n: int, seed: int, spread: float = 20.0) -> list[np.ndarray]:
    """KV-like planes: quantized Gaussians around a per-row offset (lossless x265 gets 3-6 bits)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(40, 200, size=(3, height, 1))
    return [np.clip(base + rng.normal(0, spread, size=(3, height, width)), 0, 255).astype(np.uint8) for _ in range(n)]


def _encode(frames, width, height) -> bytes:
    return X265Encoder(threads=2).encode(frames, width, height)


# -- host side: runs everywhere ------------------------------------------------------------------


@pytest.mark.parametrize("width,height,n", [(144, 144, 3), (160, 144, 5)])
def test_split_access_units_one_unit_per_frame(width, height, n):
    bs = _encode(_frames(width, height, n, seed=1), width, height)
    units = split_access_units(bs)
    assert len(units) == n
    assert units[0][0] == 0
    assert sum(length for _, length in units) == len(bs)
    for (a, la), (b, _) in zip(units, units[1:]):
        assert a + la == b
    # each unit decodes, fed alone and in order, to exactly one frame identical to the source
    import av

    ctx = av.CodecContext.create("hevc", "r")
    got = 0
    for offset, length in units:
        for packet in ctx.parse(bs[offset : offset + length]):
            got += len(ctx.decode(packet))
    for packet in ctx.parse(None):
        got += len(ctx.decode(packet))
    got += len(ctx.decode(None))
    assert got == n


def test_split_access_units_rejects_garbage():
    with pytest.raises(CorruptStreamError):
        split_access_units(b"\x12\x34" * 100)


@settings(max_examples=25, deadline=None)
@given(
    w=st.integers(1, 20).map(lambda k: 16 * k),
    h=st.integers(1, 20).map(lambda k: 8 * k),
    pitch_extra=st.integers(0, 64),
)
def test_surface_layouts_roundtrip(w, h, pitch_extra):
    rng = np.random.default_rng(w * 1000 + h)
    y, u, v = (torch.from_numpy(rng.integers(0, 256, size=(h, w), dtype=np.uint8)) for _ in range(3))
    # YUV444 planar, rows padded to a pitch
    surf = torch.zeros((3 * h, w + pitch_extra), dtype=torch.uint8)
    for k, p in enumerate((y, u, v)):
        surf[k * h : (k + 1) * h, :w] = p
    planes = surface_to_planes(surf, "YUV444", w, h)
    assert all(torch.equal(a, b) for a, b in zip(planes, (y, u, v)))
    # packed 1-d YUV444
    flat = torch.cat([y.reshape(-1), u.reshape(-1), v.reshape(-1)])
    assert all(torch.equal(a, b) for a, b in zip(surface_to_planes(flat, "YUV444", w, h), (y, u, v)))
    # NV12: Y then interleaved half-size UV
    cu, cv = u[: h // 2, : w // 2], v[: h // 2, : w // 2]
    uv = torch.stack([cu, cv], dim=-1).reshape(h // 2, w)
    nv12 = torch.cat([y, uv]).reshape(-1)
    py, pu, pv = surface_to_planes(nv12, "NV12", w, h)
    assert torch.equal(py, y) and torch.equal(pu, cu) and torch.equal(pv, cv)
    # 16-bit YUV444 with 8-bit samples MSB-aligned
    wide = torch.cat([p.to(torch.int32).reshape(-1) << 8 for p in (y, u, v)]).to(torch.int16)
    from kvcodec.video.nvdec import msb_aligned_to_int

    got = [msb_aligned_to_int(p, 8) for p in surface_to_planes(wide, "YUV444_16BIT", w, h)]
    assert all(torch.equal(a.to(torch.uint8), b) for a, b in zip(got, (y, u, v)))


def test_surface_rejects_wrong_size():
    with pytest.raises(CorruptStreamError):
        surface_to_planes(torch.zeros(3 * 16 * 16 + 5, dtype=torch.uint8), "YUV444", 16, 16)


# -- GPU: bit-exact decode -----------------------------------------------------------------------


def _cpu_decode(bs, width, height):
    return [f.numpy() for f in FFmpegHevcDecoder().decode(bs, width, height)]


@needs_nvdec
@pytest.mark.gpu
@pytest.mark.parametrize(
    "width,height,n", [(144, 144, 4), (256, 256, 6), (512, 256, 5), (1024, 1024, 3), (176, 400, 4)]
)
def test_nvdec_bit_exact_vs_cpu(width, height, n):
    src = _frames(width, height, n, seed=width + height)
    bs = _encode(src, width, height)
    ref = _cpu_decode(bs, width, height)
    assert len(ref) == n and all(np.array_equal(a, b) for a, b in zip(ref, src))
    dec = NvdecDecoder(copy=True)
    got = list(dec.decode(bs, width, height))
    assert len(got) == n
    for g, r in zip(got, ref):
        assert g.device.type == "cuda" and g.dtype == torch.uint8 and g.shape == (3, height, width)
        assert np.array_equal(g.cpu().numpy(), r)


@needs_nvdec
@pytest.mark.gpu
def test_nvdec_session_reuse_and_resize():
    dec = NvdecDecoder()
    streams = []
    for k, (w, h) in enumerate([(256, 256), (256, 256), (512, 512), (256, 256)]):
        src = _frames(w, h, 3, seed=100 + k, spread=5.0 + 10 * k)
        streams.append((src, _encode(src, w, h), w, h))
    for src, bs, w, h in streams:
        got = [f.cpu().numpy() for f in dec.decode(bs, w, h)]
        assert len(got) == len(src) and all(np.array_equal(a, b) for a, b in zip(got, src))
    assert dec.sessions_created == 2  # one session per frame size, kept


@needs_nvdec
@pytest.mark.gpu
def test_nvdec_abandoned_stream_does_not_leak_into_next():
    dec = NvdecDecoder()
    a = _frames(256, 256, 5, seed=7)
    b = _frames(256, 256, 2, seed=8)
    it = dec.decode(_encode(a, 256, 256), 256, 256)
    next(it)
    it.close()
    got = [f.cpu().numpy() for f in dec.decode(_encode(b, 256, 256), 256, 256)]
    assert len(got) == 2 and all(np.array_equal(x, y) for x, y in zip(got, b))


@needs_nvdec
@pytest.mark.gpu
def test_nvdec_wrong_size_raises():
    src = _frames(256, 256, 2, seed=3)
    with pytest.raises(CorruptStreamError):
        list(NvdecDecoder().decode(_encode(src, 256, 256), 512, 256))


@needs_nvdec
@pytest.mark.gpu
def test_nvdec_transient_frames_read_in_turn_are_exact():
    src = _frames(256, 256, 5, seed=12)
    got = [f.cpu().numpy() for f in NvdecDecoder().decode(_encode(src, 256, 256), 256, 256)]
    assert all(np.array_equal(g, s) for g, s in zip(got, src))


@needs_nvdec
@pytest.mark.gpu
def test_nvdec_frames_are_independent_copies():
    src = _frames(256, 256, 4, seed=11)
    got = list(NvdecDecoder(copy=True).decode(_encode(src, 256, 256), 256, 256))  # kept across Decode calls
    assert all(np.array_equal(g.cpu().numpy(), s) for g, s in zip(got, src))


@needs_nvdec
@pytest.mark.gpu
def test_registry_picks_an_nvdec_backend_for_cuda_driver_first():
    from kvcodec.video.nvcuvid import NvcuvidDecoder
    from kvcodec.video.registry import get_decoder

    assert get_decoder("cuda").name == ("nvcuvid" if NvcuvidDecoder.is_available() else "nvdec")
    assert get_decoder("cuda", "nvdec").name == "nvdec"


@needs_nvdec
@pytest.mark.gpu
def test_pool_bit_exact_many_streams():
    from kvcodec.video.nvdec_pool import NvdecPool

    sizes = [(256, 256), (512, 256), (144, 144), (256, 256), (1024, 512), (256, 256)]
    srcs = [_frames(w, h, 3 + k % 3, seed=200 + k) for k, (w, h) in enumerate(sizes)]
    streams = [(_encode(s, w, h), w, h) for s, (w, h) in zip(srcs, sizes)]
    seen: dict[int, list[int]] = {}
    with NvdecPool(workers=3, slots=2) as pool:
        for sid, idx, frame in pool.decode_streams(streams):
            assert frame.is_cuda
            assert np.array_equal(frame.cpu().numpy(), srcs[sid][idx])
            seen.setdefault(sid, []).append(idx)
        assert seen == {k: list(range(len(s))) for k, s in enumerate(srcs)}
        # the pool is reusable, and a corrupt stream raises without wedging it
        bad = bytearray(streams[0][0])
        with pytest.raises(CorruptStreamError):
            list(pool.decode_streams([(bytes(bad[: len(bad) // 3]), 512, 512)]))
        again = [(sid, idx) for sid, idx, _ in pool.decode_streams(streams[:2])]
        assert len(again) == len(srcs[0]) + len(srcs[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pyav_cuda_hwaccel_bit_exact():
    from kvcodec.video.nvdec_pyav import PyAVNvdecDecoder

    if not PyAVNvdecDecoder.is_available():
        pytest.skip("PyAV without the CUDA hwaccel")
    src = _frames(256, 256, 3, seed=5)
    from kvcodec.errors import BackendUnavailableError

    try:
        got = list(PyAVNvdecDecoder().decode(_encode(src, 256, 256), 256, 256))
    except BackendUnavailableError as e:  # FFmpeg cannot attach its CUDA device to torch's context here
        pytest.skip(str(e))
    assert len(got) == 3 and all(np.array_equal(g.cpu().numpy(), s) for g, s in zip(got, src))


def _small_kv(tokens: int = 80, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 2, tokens, 2, 64, generator=g) * 0.7).to(torch.float16)


@needs_nvdec
@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["int8", "int4", "exact"])
def test_codec_decode_on_cuda_matches_cpu(quant):
    import kvcodec
    from kvcodec.config import CodecConfig

    kv = _small_kv()
    data = kvcodec.encode(
        kv, CodecConfig(sample_coder="hevc", quant=quant, chunk_tokens=32, resolutions=((256, 256), (144, 144)))
    )
    for res in ((256, 256), (144, 144)):
        cpu = kvcodec.decode(data, "cpu", resolution=res)
        gpu = kvcodec.decode(data, "cuda", resolution=res)
        assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
        if quant == "exact":
            assert torch.equal(gpu.cpu(), kv)


@needs_nvdec
@pytest.mark.gpu
@pytest.mark.parametrize("where", ["workers", "consumer"])
def test_pool_decode_parallel_matches_codec(where):
    import kvcodec
    from kvcodec.codecs.hevc.pool import decode_parallel
    from kvcodec.config import CodecConfig
    from kvcodec.video.nvdec_pool import NvdecPool

    kv = _small_kv(tokens=200, seed=3)
    data = kvcodec.encode(
        kv, CodecConfig(sample_coder="hevc", quant="int8", chunk_tokens=32, resolutions=((256, 256),))
    )
    ref = kvcodec.decode(data, "cpu")
    with NvdecPool(workers=2, slots=2, max_frame=(256, 256)) as pool:
        got = decode_parallel(data, pool, threads=3, where=where)
        assert torch.equal(got.cpu(), ref)
        # into a slice of a larger cache, twice, through the same workers
        cache = torch.zeros(2, 2, 260, 2, 64, dtype=torch.float16, device=pool.device)
        for _ in range(2):
            decode_parallel(data, pool, out=cache[:, :, 30:230], where=where)
        assert torch.equal(cache[:, :, 30:230].cpu(), ref) and not cache[:, :, :30].any()


@needs_nvdec
@pytest.mark.gpu
def test_pool_restore_in_workers_reports_a_corrupt_chunk():
    import kvcodec
    from kvcodec.codec import encode_chunks
    from kvcodec.codecs.hevc.pool import restore_chunk
    from kvcodec.config import CodecConfig
    from kvcodec.video.nvdec_pool import NvdecPool

    kv = _small_kv(tokens=64, seed=4)
    chunks = encode_chunks(
        kv, CodecConfig(sample_coder="hevc", quant="int8", chunk_tokens=32, resolutions=((256, 256),))
    )
    good, bad = chunks[0].blobs[0], bytearray(chunks[1].blobs[0])
    bad[-40] ^= 0xFF
    outs = [torch.zeros(2, 2, 32, 2, 64, dtype=torch.float16, device="cuda") for _ in range(2)]
    with (
        NvdecPool(workers=2, slots=2, max_frame=(256, 256)) as pool,
        pytest.raises(CorruptStreamError, match="chunk 1"),
    ):
        pool.restore_blobs([good, bytes(bad)], outs, decode_into=restore_chunk)
    assert torch.equal(outs[0].cpu(), kvcodec.codec.decode_chunk_blob(good, "cpu"))


@needs_nvdec
@pytest.mark.gpu
@pytest.mark.parametrize("hold", [0.0, 0.2])
def test_pool_workers_release_the_consumers_output_when_idle(hold):
    import time

    import kvcodec
    from kvcodec.codecs.hevc.pool import decode_parallel
    from kvcodec.config import CodecConfig
    from kvcodec.video.nvdec_pool import NvdecPool

    kv = _small_kv(tokens=128, seed=5)
    data = kvcodec.encode(
        kv, CodecConfig(sample_coder="hevc", quant="int8", chunk_tokens=32, resolutions=((256, 256),))
    )
    ref = kvcodec.decode(data, "cpu")
    with NvdecPool(workers=2, slots=2, max_frame=(256, 256), hold_output_s=hold) as pool:
        decode_parallel(data, pool)  # workers warm
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(pool.device)
        out = torch.empty(64 << 20, dtype=torch.uint8, device=pool.device)  # its own allocation, bigger than a block
        view = out[: ref.numel() * 2].view(torch.float16).view(ref.shape)
        decode_parallel(data, pool, out=view)
        assert torch.equal(view.cpu(), ref)
        del out, view
        deadline = time.monotonic() + hold + 5.0
        while torch.cuda.memory_allocated(pool.device) > before and time.monotonic() < deadline:
            time.sleep(0.05)
            torch.cuda.ipc_collect()  # frees what the workers have let go of
        assert torch.cuda.memory_allocated(pool.device) <= before
