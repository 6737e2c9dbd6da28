"""The transform codec's mixed coder: odd chunks zstd-coded, even ones HEVC-coded (header.chunk_coder),
the same integers as either coder alone, and files whose every chunk must carry the coder the rule
gives its index."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcodec.codecs.transform.codec import TransformCodec
from kvcodec.codecs.transform.file import decode_file, describe, encode_file, read_header
from kvcodec.codecs.transform.header import chunk_coder
from kvcodec.container.format import crc32, read_object, write_object
from kvcodec.errors import FormatError
from synthetic import synthetic_kv


def _codec(synthetic_kvt, **kw) -> TransformCodec:
    return TransformCodec(synthetic_kvt, **{"chunk_tokens": 64, "resolutions": ((64, 64),), **kw})


@given(st.integers(0, 1 << 20))
def test_the_rule_alternates_and_leaves_single_coders_alone(index):
    assert chunk_coder("mixed", index) == ("zstd" if index % 2 else "hevc")
    assert chunk_coder("mixed", index) != chunk_coder("mixed", index + 1)
    assert chunk_coder("hevc", index) == "hevc" and chunk_coder("zstd", index) == "zstd"


@pytest.mark.parametrize("first_chunk_index", [0, 3])
def test_mixed_chunks_restore_what_either_coder_restores(synthetic_kvt, first_chunk_index):
    kv = synthetic_kv(200, seed=5, first=64 * first_chunk_index)
    mixed = _codec(synthetic_kvt, coder="mixed", bits_per_value=2.0)
    chunks = mixed.encode_chunks(kv, first_chunk_index=first_chunk_index)
    headers = [mixed.header(c.blobs[0]) for c in chunks]
    assert [h["coder"] for h in headers] == [chunk_coder("mixed", c.index) for c in chunks]
    assert {h["coder"] for h in headers} == {"hevc", "zstd"}
    theta = headers[0]["theta"]
    for coder in ("hevc", "zstd"):
        single = _codec(synthetic_kvt, coder=coder, theta=theta).encode_chunks(kv, first_chunk_index=first_chunk_index)
        for a, b in zip(chunks, single):
            want, got = torch.empty_like(kv[:, :, : a.tokens]), torch.empty_like(kv[:, :, : a.tokens])
            mixed.decode_chunk(a.blobs[0], got)
            _codec(synthetic_kvt, coder=coder, theta=theta).decode_chunk(b.blobs[0], want)
            assert torch.equal(got, want)


def test_mixed_is_a_codec_of_its_own(synthetic_kvt):
    ids = {_codec(synthetic_kvt, coder=c).id for c in ("hevc", "zstd", "mixed")}
    assert len(ids) == 3


def test_a_mixed_file_round_trips_and_says_so(synthetic_kvt):
    kv = synthetic_kv(300, seed=6)
    codec = _codec(synthetic_kvt, coder="mixed", bits_per_value=2.0)
    data = encode_file(kv, codec)
    assert read_header(data)[0]["settings"]["coder"] == "mixed"
    assert describe(data)["coder"] == "mixed"
    restored = decode_file(data, codec)
    one_by_one = torch.empty_like(kv)
    for c in codec.encode_chunks(kv, keys=None):
        codec.decode_chunk(c.blobs[0], one_by_one[:, :, c.start_token : c.start_token + c.tokens])
    assert torch.equal(restored, one_by_one)


def _with_chunk(data: bytes, index: int, blob: bytes) -> bytes:
    """The file with chunk `index` replaced by `blob`, the file's entry for it made consistent."""
    h, payload = read_object(data, b"KVTF", "file")
    blobs, pos = [], 0
    for _, length, _ in h["chunks"]:
        blobs.append(bytes(payload[pos : pos + length]))
        pos += length
    blobs[index] = blob
    h["chunks"] = [[e[0], len(b), crc32(b)] for e, b in zip(h["chunks"], blobs)]
    return write_object(b"KVTF", h, blobs)


@pytest.mark.parametrize("index", [0, 1])
def test_a_chunk_coded_by_the_other_coder_is_refused(synthetic_kvt, index):
    """The same KV, level and key, coded by the coder the rule does not give that index: refused."""
    kv = synthetic_kv(200, seed=4)
    codec = _codec(synthetic_kvt, coder="mixed", bits_per_value=2.0)
    data = encode_file(kv, codec)
    h = read_header(data)[0]
    other = "hevc" if chunk_coder("mixed", index) == "zstd" else "zstd"
    single = _codec(synthetic_kvt, coder=other, theta=h["settings"]["theta"])
    single.id = codec.id  # the same codec name: only the coder differs
    key = f"{h['file_id']}/{index}"
    blob = single.encode_chunks(kv, keys=[key if i == index else None for i in range(4)])[index].blobs[0]
    with pytest.raises(FormatError, match="coder"):
        decode_file(_with_chunk(data, index, blob), codec)


def test_mixed_chunks_prepared_together_are_those_prepared_one_by_one(synthetic_kvt):
    """The batched preparation (a GPU's encode) gives each chunk its coder's payload, as alone."""
    codec = _codec(synthetic_kvt, coder="mixed", bits_per_value=2.0, fine_tokens=0)
    kv = synthetic_kv(320, seed=3)
    theta = codec._level(None, kv, 0)
    y = codec.coefficients(kv, 0, codec.plan(theta).counts)
    together = codec._prepare_batch(y[64:256], theta, 64, 3)
    for k, (batched,) in enumerate(together):
        s = 64 * (k + 1)
        (alone,) = codec._prepare(y[s : s + 64], kv[:, :, s : s + 64], theta, s, 0)  # its one resolution, 64x64
        assert batched[:2] == alone[:2] and batched[1]["coder"] == chunk_coder("mixed", k + 1)
        pending = (lambda p: p) if batched[1]["coder"] == "zstd" else (lambda p: [f.tolist() for f in p])
        assert pending(batched[2]) == pending(alone[2])


def test_a_mixed_level_is_set_by_both_coders_bytes(synthetic_kvt):
    """The size search measures each sampled chunk under both coders (each codes half the chunks),
    so the ratio is met whichever indices the sample falls on."""
    kv = synthetic_kv(512, seed=11)
    c = _codec(synthetic_kvt, coder="mixed")
    theta = c._level(None, kv, 0)
    y = c.coefficients(kv, 0, c.plan(theta).counts)
    both = [
        _codec(synthetic_kvt, coder=k)._payload_bytes(y[64:128], kv[:, :, 64:128], theta, 64) for k in ("hevc", "zstd")
    ]
    mixed = c._payload_bytes(y[64:128], kv[:, :, 64:128], theta, 64)
    assert abs(mixed - sum(both) / 2) <= 2  # the headers name the codec: "mixed" is a letter longer
    for r in (4.0, 8.0):
        chunks = _codec(synthetic_kvt, coder="mixed", target_ratio=r).encode_chunks(kv)
        size = sum(len(ch.blobs[0]) for ch in chunks)
        assert abs(kv.numel() * 2 / r / size - 1) < 0.10, (r, kv.numel() * 2 / size)
