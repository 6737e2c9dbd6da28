"""Chunks whose samples are zstd-coded instead of HEVC-coded: the same values, restored in one pass."""

import dataclasses

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcodec
from kvcodec import CodecConfig, PagedKV
from kvcodec.codec import decode_chunk_blob, encode_chunks
from kvcodec.container.format import CHUNK_MAGIC, StreamEntry, crc32, parse_chunk, split_streams, write_object
from kvcodec.errors import CorruptStreamError, KVCodecError

SMALL = ((144, 144),)


def _kv(tokens: int, dtype=torch.float16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 2, tokens, 2, 32, generator=g) * torch.linspace(0.1, 2, 32)).to(dtype)


def _config(coder: str, **options) -> CodecConfig:
    return CodecConfig(
        **{"chunk_tokens": 24, "resolutions": SMALL, "plain_fallback": False, **options}, sample_coder=coder
    )


@given(
    st.integers(1, 60),
    st.sampled_from(["int8", "int4", "int3", "exact"]),
    st.sampled_from(["auto", 2, 8]),
    st.sampled_from([torch.float16, torch.bfloat16]),
)
@settings(max_examples=16, deadline=None)
def test_zstd_samples_restore_the_values_the_video_restores(tokens, quant, video_bits, dtype):
    kv = _kv(tokens, dtype, seed=tokens)
    video_bits = 8 if quant == "exact" else video_bits
    options = {"quant": quant, "video_bits": video_bits}
    from_video = kvcodec.decode(kvcodec.encode(kv, _config("hevc", **options)))
    from_samples = kvcodec.decode(kvcodec.encode(kv, _config("zstd", **options)))
    assert torch.equal(from_samples.view(torch.int16), from_video.view(torch.int16))


def test_zstd_samples_fill_the_blocks_of_a_paged_cache():
    kv = _kv(50)
    encoded = kvcodec.encode(kv, _config("zstd"))
    dense = kvcodec.decode(encoded)
    pages = torch.full((2, 2, 10, 8, 2, 32), float("nan"), dtype=torch.float16)
    table = torch.tensor([9, 2, 7, 0, 5, 3, 1])
    kvcodec.decode(encoded, out=PagedKV(pages, table))
    assert torch.equal(PagedKV(pages, table).gather(0, 50).view(torch.int16), dense.view(torch.int16))
    assert torch.isnan(pages[:, :, [4, 6, 8]]).all()


def _rewritten(blob: bytes, **changes) -> bytes:
    """The chunk blob with its header fields changed (its streams and their checksums kept)."""
    h, payload = parse_chunk(blob)
    return write_object(CHUNK_MAGIC, dataclasses.replace(h, **changes).to_json(), [bytes(payload)])


def test_a_zstd_chunk_announcing_other_frames_than_its_tokens_fill_is_refused():
    blob = encode_chunks(_kv(24), _config("zstd"))[0].blobs[0]
    h, _ = parse_chunk(blob)
    with pytest.raises(KVCodecError):
        decode_chunk_blob(_rewritten(blob, frames=h.frames + 1))


def test_a_zstd_sample_stream_of_the_wrong_size_is_refused():
    blob = encode_chunks(_kv(24), _config("zstd"))[0].blobs[0]
    h, payload = parse_chunk(blob)
    streams = split_streams(payload, h.streams, "chunk")
    samples = zstandard.decompress(bytes(streams["samples"]))
    for wrong in (samples[:-1], samples + b"\0"):
        streams["samples"] = zstandard.compress(wrong)
        entries = tuple(StreamEntry(e.name, e.codec, len(streams[e.name]), crc32(streams[e.name])) for e in h.streams)
        forged = dataclasses.replace(h, streams=entries)
        blob = write_object(CHUNK_MAGIC, forged.to_json(), [bytes(streams[e.name]) for e in h.streams])
        with pytest.raises(CorruptStreamError, match="sample stream has the wrong size"):
            decode_chunk_blob(blob)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("quant", ["int8", "int4", "exact"])
def test_zstd_samples_restore_on_cuda_as_on_the_cpu(quant):
    kv = _kv(60)
    encoded = kvcodec.encode(kv, _config("zstd", quant=quant, video_bits=8))
    on_cpu = kvcodec.decode(encoded)
    on_gpu = kvcodec.decode(encoded, "cuda")
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu().view(torch.int16), on_cpu.view(torch.int16))


@needs_cuda
@pytest.mark.parametrize("driven", [True, False])
def test_a_cuda_fetch_of_zstd_chunks_gets_the_cpu_fetch_values(driven):
    from kvcodec.codecs.hevc.codec import HevcCodec
    from kvcodec.fetcher import DecodeProfile, PrefixCache
    from kvcodec.store import open_store

    kv, ids = _kv(100), torch.arange(100)
    codec = HevcCodec(_config("zstd", video_bits=8))
    store = open_store("memory://")
    caches = {
        d: PrefixCache(store, "m", codec, d, profile=DecodeProfile.default(codec.resolutions), batched_restore=driven)
        for d in ("cpu", "cuda")
    }
    caches["cpu"].put(ids, kv)
    want, got = caches["cpu"].fetch(ids), caches["cuda"].fetch(ids)
    assert want.ok and got.ok and got.tokens_restored == 100
    assert torch.equal(got.kv.cpu().view(torch.int16), want.kv.view(torch.int16))


@pytest.mark.parametrize("quant", ["int8", "exact"])
def test_split_chunks_with_zstd_samples_restore_the_values_of_split_videos(quant):
    kv = torch.cat([_kv(40), _kv(40, seed=1)])  # 4 layers: two streams of two layers each
    options = {"quant": quant, "streams_per_chunk": 2, "video_bits": 8}
    from_video = kvcodec.decode(kvcodec.encode(kv, _config("hevc", **options)))
    encoded = kvcodec.encode(kv, _config("zstd", **options))
    assert "samples" in kvcodec.inspect(encoded)["resolutions"]["144x144"]["streams"]
    assert torch.equal(kvcodec.decode(encoded).view(torch.int16), from_video.view(torch.int16))
