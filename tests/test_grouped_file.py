"""Grouped KV files (KVGF): a whole multi-group prefix in one file, and damaged or foreign input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

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


def _edited(data: bytes, edit) -> bytes:
    """A grouped file with its header edited by edit(header) and its header checksum recomputed."""
    from kvcodec.container.format import read_object, write_object

    header, payload = read_object(data, b"KVGF", "grouped file")
    edit(header)
    end = max(b["offset"] + b["length"] for b in header["blobs"])  # blobs dropped from the end: their bytes too
    return write_object(b"KVGF", header, [bytes(payload[:end])])


def _drop_last_chunk(h: dict) -> None:
    last = (h["stop"] - 1) // h["chunk_tokens"]
    h["blobs"] = [b for b in h["blobs"] if b["chunk_index"] != last]
    h["stop"] = last * h["chunk_tokens"]
    h["starts"] = [min(s, h["stop"]) for s in h["starts"]]


def _retype(h: dict) -> None:
    h["spec"]["dtype"] = "float16"


def _later_start(h: dict) -> None:
    h["starts"][1] = 20  # the full group said to hold positions from 20, not 0


@pytest.mark.parametrize("edit,field", [(_retype, "spec"), (_later_start, "parts"), (_drop_last_chunk, "key")])
def test_consistent_header_edits_are_refused_not_decoded_into_other_values(edit, field):
    """A file header edited consistently (its checksum recomputed): another dtype, a group's later first
    position, the last chunk dropped. Each decoded before without an error: values cast, positions lost, a
    shorter prefix."""
    codec = GroupedCodec(make_codec("raw", chunk_tokens=8))
    kv = _kv(24)
    data = encode_grouped(kv, codec)
    assert decode_grouped(data, codec).equal(kv)
    bad = _edited(data, edit)
    with pytest.raises(FormatError, match=f"says {field}="):
        decode_grouped(bad, codec)
    from kvcodec.codecs.grouped_file import describe

    with pytest.raises(FormatError):
        describe(bad)


@given(st.lists(st.integers(0, 64), min_size=1, max_size=5), st.integers(0, 63), st.integers(1, 64))
def test_expected_parts_are_each_groups_positions_of_the_chunk(starts, start, length):
    from kvcodec.codecs.grouped_file import expected_parts

    stop = start + length
    parts = expected_parts(starts, start, stop)
    assert [g for g, _, _ in parts] == sorted(g for g, s in enumerate(starts) if s < stop)  # group order, held ones
    for g, first, n in parts:
        assert first == max(starts[g], start) and first + n == stop and n > 0


def test_a_plain_chunk_in_a_grouped_file_is_a_format_error():
    from kvcodec.container.format import read_object, write_object

    inner = make_codec("raw", chunk_tokens=8)
    codec = GroupedCodec(inner)
    data = encode_grouped(_kv(24), codec)
    header, payload = read_object(data, b"KVGF", "grouped file")
    first = next(b for b in header["blobs"] if b["chunk_index"] == 0)
    plain = inner.encode_chunks(torch.zeros(1, 2, 8, 2, 8, dtype=torch.bfloat16))[0].blobs[0]
    from kvcodec.container.format import crc32

    rest = bytes(payload[first["length"] :])
    shift = len(plain) - first["length"]
    for b in header["blobs"]:
        b["offset"] += shift if b is not first else 0
    first.update(length=len(plain), crc32=crc32(plain))
    with pytest.raises(FormatError, match="not a grouped chunk"):
        decode_grouped(write_object(b"KVGF", header, [plain + rest]), codec)
