"""Baselines as kvcodec ChunkCodecs: every CPU baseline stores and restores chunk by chunk into a
dense slice and into paged KV, its headers say which chunk a blob is, and damage or a foreign blob
is a KVCodecError."""

import pytest
import torch

from kvbench.baselines import available_codecs
from kvbench.baselines.chunk import BaselineCodec, register_chunk_codecs
from kvcodec.codecs.base import ChunkCodec
from kvcodec.codecs.registry import make_codec, registered_codecs
from kvcodec.errors import KVCodecError, ShapeError
from kvcodec.restore.paged import PagedKV

CPU_BASELINES = [n for n in ("zstd-3", "lz4-shuffle", "int8-zstd-19", "cachegen") if n in available_codecs()]
LOSSLESS = {"zstd-3", "lz4-shuffle"}


def kv_of(tokens=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(3, 2, tokens, 2, 16, generator=g) * 2).to(torch.float16)


@pytest.mark.parametrize("name", CPU_BASELINES)
def test_chunks_round_trip_into_dense_slices(name):
    codec = BaselineCodec(name, chunk_tokens=128)
    assert isinstance(codec, ChunkCodec)
    kv = kv_of()
    chunks = codec.encode_chunks(kv, first_chunk_index=2, keys=["a", "b", "c"])
    assert [c.tokens for c in chunks] == [128, 128, 44]
    out = torch.full_like(kv, float("nan"))
    for c in chunks:
        info = codec.inspect_chunk(c.blobs[0])
        assert (info.index, info.start_token, info.key) == (c.index, c.start_token, "abc"[c.index - 2])
        assert info.shape == (3, 2, c.tokens, 2, 16) and info.dtype == "float16"
        local = c.start_token - 2 * 128
        codec.decode_chunk(c.blobs[0], out[:, :, local : local + c.tokens])
    assert not out.isnan().any()
    if name in LOSSLESS:
        assert torch.equal(out, kv)
    else:
        assert (out.float() - kv.float()).abs().max() < 0.5 * kv.float().abs().max()


def test_decode_into_paged_kv_matches_dense():
    codec = BaselineCodec("zstd-3", chunk_tokens=64)
    kv = kv_of(tokens=128)
    pages = torch.zeros(3, 2, 10, 16, 2, 16, dtype=torch.float16)
    paged = PagedKV(pages, torch.tensor([7, 1, 4, 0, 9, 2, 3, 8]))
    for c in codec.encode_chunks(kv):
        codec.decode_chunk(c.blobs[0], paged)
    assert torch.equal(paged.gather(0, 128), kv)


def test_foreign_damaged_and_misshaped_blobs_are_refused():
    kv = kv_of(tokens=64)
    blob = BaselineCodec("zstd-3", chunk_tokens=64).encode_chunks(kv)[0].blobs[0]
    with pytest.raises(KVCodecError):
        BaselineCodec("lz4", chunk_tokens=64).inspect_chunk(blob)
    damaged = bytearray(blob)
    damaged[-5] ^= 0xFF
    with pytest.raises(KVCodecError):
        BaselineCodec("zstd-3", chunk_tokens=64).decode_chunk(bytes(damaged), torch.empty_like(kv))
    with pytest.raises(KVCodecError):
        BaselineCodec("zstd-3").inspect_chunk(blob[: len(blob) // 2])
    with pytest.raises(ShapeError):
        BaselineCodec("zstd-3").decode_chunk(blob, torch.empty(3, 2, 63, 2, 16, dtype=torch.float16))


def test_registered_in_kvcodecs_codec_registry():
    assert isinstance(make_codec("baseline", baseline="cachegen"), BaselineCodec)
    register_chunk_codecs()
    names = registered_codecs()
    assert "cachegen" in names and "zstd-19" in names
    assert make_codec("zstd-19", chunk_tokens=32).chunk_tokens == 32
    assert make_codec("raw").id != make_codec("zstd-3").id  # kvcodec's own raw is not replaced


def test_ids_differ_by_baseline_and_chunking():
    ids = {BaselineCodec("zstd-3").id, BaselineCodec("zstd-19").id, BaselineCodec("zstd-3", chunk_tokens=128).id}
    assert len(ids) == 3
