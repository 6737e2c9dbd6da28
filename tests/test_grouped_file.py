"""Grouped KV files (KVGF): a whole multi-group prefix in one file, and damaged or foreign input."""

from __future__ import annotations

import pytest
import torch

from kvcodec.codecs import make_codec
from kvcodec.codecs.grouped import GroupedCodec
from kvcodec.codecs.grouped_file import decode_grouped, encode_grouped, inspect_grouped
from kvcodec.errors import ChecksumError, ConfigError, FormatError
from kvcodec.kvspec import GroupedKV, KVSpec, LayerSpec

SPEC = KVSpec(
    (
        LayerSpec("sliding", (2, 8), (2, 8), keep=9),
        LayerSpec("full", (2, 8), (2, 8)),
        LayerSpec("mla", (1, 16), (1, 4)),
    ),
    "bfloat16",
)


def _kv(stop: int) -> GroupedKV:
    torch.manual_seed(stop)
    kv = GroupedKV.empty(SPEC, stop, window=False)
    for t in kv.tensors:
        t.copy_(torch.randn(t.shape))
    return kv.prefix(stop)  # what a cache holds: the sliding group only its window


@pytest.mark.parametrize("name,options", [("raw", {"variants": ("raw", "zstd")}), ("hevc", {"quant": "exact"})])
def test_file_roundtrip_every_resolution(name, options):
    codec = GroupedCodec(make_codec(name, chunk_tokens=8, **options))
    kv = _kv(21)
    data = encode_grouped(kv, codec)
    for res in codec.resolutions:
        assert decode_grouped(data, codec, resolution=res).equal(kv)
    info = inspect_grouped(data)
    assert info["tokens"] == 21 and info["layers"] == 3 and info["dtype"] == "bfloat16"
    assert [(g["name"], g["start"]) for g in info["groups"]] == [
        ("sliding9-kv-2x8", 12),
        ("full-kv-2x8", 0),
        ("mla-latent-1x8", 0),
        ("mla-rope-1x2", 0),
    ]
    assert set(info["bytes_per_resolution"]) == {"x".join(map(str, r)) for r in codec.resolutions}


def test_damaged_or_foreign_files_are_refused():
    codec = GroupedCodec(make_codec("raw", chunk_tokens=8))
    data = encode_grouped(_kv(21), codec)
    with pytest.raises(ConfigError, match="written by codec"):
        decode_grouped(data, GroupedCodec(make_codec("raw", chunk_tokens=4)))
    with pytest.raises(FormatError):
        decode_grouped(data[:-10], codec)
    flipped = bytearray(data)
    flipped[-5] ^= 0x40
    with pytest.raises(ChecksumError):
        decode_grouped(bytes(flipped), codec)
    with pytest.raises(FormatError):
        inspect_grouped(codec.encode_chunks(_kv(8))[0].blobs[0])  # a chunk blob, not a file
    with pytest.raises(ConfigError):
        encode_grouped(_kv(8), make_codec("raw"))
