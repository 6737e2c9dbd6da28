"""The fused Triton restorer against the torch reference, value for value: the compiled kernel on a
CUDA GPU, and its source under Triton's interpreter on the CPU (CI)."""

import pytest
import torch

from kvcodec import CodecConfig
from kvcodec.codec import decode_chunk_blob, encode_chunks
from kvcodec.restore import triton_restore
from kvcodec.video.x265_cpu import FFmpegHevcDecoder

needs_triton = pytest.mark.skipif(not triton_restore.available(), reason="needs a CUDA GPU and Triton")


def _kv(layers=3, tokens=70, heads=2, dim=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, tokens, heads, dim, generator=g) * torch.linspace(0.1, 3, dim)
    kv[:, 0, 0] *= 15
    return kv.to(torch.float16)


@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize(
    "quant, layer_bits, video_bits",
    [("int8", (), 8), ("int8", (), 4), ("int4", (), 3), ("int6", (), 2), ("int8", (8, 4, 6), 5)],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("wide", [False, True])  # the kernel's int32 index arithmetic, and its int64 one
def test_fused_restore_equals_reference(quant, layer_bits, video_bits, dtype, wide, monkeypatch):
    monkeypatch.setattr(triton_restore, "FORCE_WIDE", wide)
    kv = _kv().to(dtype)
    config = CodecConfig(
        sample_coder="hevc",
        quant=quant,
        layer_bits=layer_bits,
        chunk_tokens=48,
        resolutions=((256, 256), (144, 144)),
        video_bits=video_bits,
    )
    for chunk in encode_chunks(kv, config):
        for blob in chunk.blobs:
            # into a slice of a larger cache, so the kernel honours the output's strides
            ref_cache = torch.zeros(3, 2, 100, 2, 64, dtype=dtype, device="cuda")
            got_cache = torch.zeros_like(ref_cache)
            span = slice(10, 10 + chunk.tokens)
            decode_chunk_blob(blob, out=ref_cache[:, :, span], decoder=FFmpegHevcDecoder(), restore="torch")
            decode_chunk_blob(blob, out=got_cache[:, :, span], decoder=FFmpegHevcDecoder(), restore="triton")
            assert torch.equal(got_cache, ref_cache)
            cpu = decode_chunk_blob(blob, "cpu")
            assert torch.equal(got_cache[:, :, span].cpu(), cpu)


@needs_triton
@pytest.mark.gpu
def test_fused_restorer_refuses_exact_mode():
    kv = _kv(tokens=20)
    # plain_fallback off: a 20-token chunk would otherwise be stored plain, with no frames to restore
    config = CodecConfig(
        sample_coder="hevc", quant="exact", chunk_tokens=20, resolutions=((144, 144),), plain_fallback=False
    )
    (chunk,) = encode_chunks(kv, config)
    with pytest.raises(ValueError, match="exact"):
        decode_chunk_blob(chunk.blobs[0], "cuda", decoder=FFmpegHevcDecoder(), restore="triton")
    out = decode_chunk_blob(chunk.blobs[0], "cuda", decoder=FFmpegHevcDecoder())  # auto falls back to torch
    assert torch.equal(out.cpu().view(torch.int16), kv.view(torch.int16))


@needs_triton
@pytest.mark.gpu
def test_warm_up_compiles_for_every_output_dtype():
    triton_restore.warm_up("cuda", dtypes=(torch.float16, torch.bfloat16, torch.float32))


@needs_triton
@pytest.mark.gpu
def test_the_codecs_warm_up_compiles_what_its_first_restores_need():
    from kvcodec import PagedKV
    from kvcodec.codecs.base import WarmUp
    from kvcodec.codecs.hevc.codec import HevcCodec

    kernel = triton_restore._kernel()
    if not hasattr(kernel, "device_caches"):
        pytest.skip("this Triton keeps no per-device kernel caches to count")
    config = CodecConfig(chunk_tokens=48, resolutions=((256, 256),))  # the default coder: video and zstd'd planes
    kv = _kv(tokens=96).to(torch.bfloat16)
    chunks = encode_chunks(kv, config)
    codec = HevcCodec(config, decoder=FFmpegHevcDecoder())
    kernel.device_caches.clear()  # compiled again (from Triton's disk cache): the count starts at zero
    assert isinstance(codec, WarmUp)
    codec.warm_up("cuda", torch.bfloat16)
    warmed = sum(len(entry[0]) for entry in kernel.device_caches.values())
    assert warmed >= 1
    out = torch.empty(kv.shape, dtype=torch.bfloat16, device="cuda")
    paged = PagedKV(torch.zeros(3, 2, 12, 8, 2, 64, dtype=torch.bfloat16, device="cuda"), torch.randperm(12))
    for c in chunks:
        codec.decode_chunk(c.blobs[0], out[:, :, c.start_token : c.start_token + c.tokens])
        codec.decode_chunk(c.blobs[0], paged)  # an integration's blocks (vLLM), a fetch's PagedKV `out`
    torch.cuda.synchronize()
    assert sum(len(entry[0]) for entry in kernel.device_caches.values()) == warmed  # nothing compiled since
    assert torch.equal(paged.gather(0, 96), out)


@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("quant, video_bits", [("int8", 4), ("int4", 8)])
def test_fused_restore_into_a_paged_cache_equals_reference(quant, video_bits):
    from kvcodec import PagedKV

    kv = _kv()
    config = CodecConfig(
        sample_coder="hevc", quant=quant, chunk_tokens=48, resolutions=((256, 256),), video_bits=video_bits
    )
    table = torch.tensor([11, 3, 5, 0, 9, 2, 7, 1, 4])
    ref = PagedKV(torch.zeros(3, 2, 12, 8, 2, 64, dtype=torch.float16, device="cuda"), table)
    got = PagedKV(torch.zeros_like(ref.pages), table)
    for chunk in encode_chunks(kv, config):
        decode_chunk_blob(chunk.blobs[0], out=ref, decoder=FFmpegHevcDecoder(), restore="torch")
        decode_chunk_blob(chunk.blobs[0], out=got, decoder=FFmpegHevcDecoder(), restore="triton")
    assert torch.equal(got.pages, ref.pages) and ref.pages.any()


@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("quant, video_bits", [("int8", 8), ("int4", 8), ("int8", 5)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("wide", [False, True])
def test_fused_restore_of_zstd_samples_equals_reference(quant, video_bits, dtype, wide, monkeypatch):
    from kvcodec import PagedKV

    monkeypatch.setattr(triton_restore, "FORCE_WIDE", wide)
    kv = _kv().to(dtype)
    config = CodecConfig(sample_coder="zstd", quant=quant, chunk_tokens=48, video_bits=video_bits)
    table = torch.tensor([11, 3, 5, 0, 9, 2, 7, 1, 4])
    for chunk in encode_chunks(kv, config):
        (blob,) = chunk.blobs
        ref_cache = torch.zeros(3, 2, 100, 2, 64, dtype=dtype, device="cuda")
        got_cache = torch.zeros_like(ref_cache)
        span = slice(7, 7 + chunk.tokens)
        decode_chunk_blob(blob, out=ref_cache[:, :, span], restore="torch")
        decode_chunk_blob(blob, out=got_cache[:, :, span], restore="triton")
        assert torch.equal(got_cache, ref_cache) and ref_cache.any()
        ref = PagedKV(torch.zeros(3, 2, 12, 8, 2, 64, dtype=dtype, device="cuda"), table)
        got = PagedKV(torch.zeros_like(ref.pages), table)
        decode_chunk_blob(blob, out=ref, restore="torch")
        decode_chunk_blob(blob, out=got, restore="triton")
        assert torch.equal(got.pages, ref.pages) and ref.pages.any()


@needs_triton
@pytest.mark.gpu
def test_fused_restore_block_refuses_samples_of_another_shape():
    kv = _kv(tokens=48)
    (chunk,) = encode_chunks(kv, CodecConfig(sample_coder="zstd", chunk_tokens=48, video_bits=8))
    from kvcodec.codecs.hevc.decode import _chunk_terms, _layout
    from kvcodec.container.format import parse_chunk, split_streams

    h, payload = parse_chunk(chunk.blobs[0])
    terms = _chunk_terms(h, _layout(h), split_streams(payload, h.streams, "c"), torch.float16, "cuda")
    restorer = triton_restore.TritonRestorer(terms)
    with pytest.raises(ValueError, match="samples of shape"):
        restorer.restore_block(terms.samples[:, :40], 0, 48, torch.empty(3, 2, 48, 2, 64, device="cuda"))


# --------------------------------------------------- the kernel's source, interpreted on the CPU


@pytest.fixture
def interpreted(triton_interpreter, monkeypatch):
    kernel = triton_restore._kernel.__wrapped__()  # made now: under the interpreter
    monkeypatch.setattr(triton_restore, "_kernel", lambda: kernel)


@pytest.mark.parametrize(
    "sample_coder, quant, layer_bits, video_bits",
    [("hevc", "int8", (), 8), ("hevc", "int4", (), 3), ("hevc", "int8", (8, 4), 5), ("zstd", "int8", (), 6)],
)
@pytest.mark.parametrize("wide", [False, True])
def test_the_fused_restorer_s_source_equals_the_reference(
    interpreted, sample_coder, quant, layer_bits, video_bits, wide, monkeypatch
):
    from kvcodec import PagedKV

    monkeypatch.setattr(triton_restore, "FORCE_WIDE", wide)
    kv = _kv(layers=2, tokens=40, heads=2, dim=16)
    config = CodecConfig(
        sample_coder=sample_coder,
        quant=quant,
        layer_bits=layer_bits,
        chunk_tokens=24,
        resolutions=((144, 144),),
        video_bits=video_bits,
        plain_fallback=False,
    )
    table = torch.tensor([5, 1, 3, 0, 4, 2])
    for chunk in encode_chunks(kv, config):
        for blob in chunk.blobs:
            ref_cache = torch.zeros(2, 2, 60, 2, 16, dtype=torch.float16)
            got_cache = torch.zeros_like(ref_cache)
            span = slice(9, 9 + chunk.tokens)  # a slice of a larger cache: the kernel honours the strides
            decode_chunk_blob(blob, out=ref_cache[:, :, span], decoder=FFmpegHevcDecoder(), restore="torch")
            decode_chunk_blob(blob, out=got_cache[:, :, span], decoder=FFmpegHevcDecoder(), restore="triton")
            assert torch.equal(got_cache, ref_cache) and ref_cache.any()
            # a paged cache: blocks of 8 tokens, out of order
            ref = PagedKV(torch.zeros(2, 2, 6, 8, 2, 16, dtype=torch.float16), table)
            got = PagedKV(torch.zeros_like(ref.pages), table)
            decode_chunk_blob(blob, out=ref, decoder=FFmpegHevcDecoder(), restore="torch")
            decode_chunk_blob(blob, out=got, decoder=FFmpegHevcDecoder(), restore="triton")
            assert torch.equal(got.pages, ref.pages) and ref.pages.any()
