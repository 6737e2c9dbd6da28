"""The transform-ans codec (codecs/transform_ans): the transform codec's integers rANS-coded, its
KVTA chunks checked, files and commands; on the CPU (the numpy reference decodes)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from kvcodec.codecs.base import ChunkCodec
from kvcodec.codecs.registry import make_codec
from kvcodec.codecs.transform.codec import TransformCodec
from kvcodec.codecs.transform_ans import TransformAnsCodec
from kvcodec.container.format import crc32
from kvcodec.errors import ChecksumError, ConfigError, FormatError, KVCodecError, TruncatedError
from kvcodec.restore.paged import PagedKV
from kvcodec.transform import calibrate, save_kvt
from synthetic import ROPE, rel_mse, synthetic_kv


@pytest.fixture(scope="module")
def coded(synthetic_kvt):
    kv = synthetic_kv(150, seed=7)
    codec = TransformAnsCodec(synthetic_kvt, chunk_tokens=64, bits_per_value=3.0, block=4096)
    return kv, codec, codec.encode_chunks(kv)


def decode_all(codec, chunks, like):
    out = torch.empty_like(like)
    for ch in chunks:
        codec.decode_chunk(ch.blobs[0], out[:, :, ch.start_token : ch.start_token + ch.tokens])
    return out


def test_same_integers_and_values_as_the_transform_codec(synthetic_kvt, coded):
    kv, codec, chunks = coded
    ref = TransformCodec(synthetic_kvt, chunk_tokens=64, bits_per_value=3.0, coder="zstd")
    assert isinstance(codec, ChunkCodec) and codec.id.startswith("transform-ans1-")
    assert torch.equal(decode_all(codec, chunks, kv), decode_all(ref, ref.encode_chunks(kv), kv))
    assert rel_mse(decode_all(codec, chunks, kv), kv) < 0.05


def test_staged_batch_and_paged_target(coded):
    kv, codec, chunks = coded
    dense = decode_all(codec, chunks, kv)
    out = torch.empty_like(kv)
    outs = [out[:, :, ch.start_token : ch.start_token + ch.tokens] for ch in chunks]
    codec.finish([codec.stage(ch.blobs[0], o) for ch, o in zip(chunks, outs)], outs)
    assert (out.float() - dense.float()).abs().max() < 1e-2  # batched math vs the reference GEMMs
    L, _, T, H, D = kv.shape
    paged = PagedKV(torch.zeros(L, 2, 12, 16, H, D, dtype=kv.dtype), torch.randperm(12)[:10])
    for ch in chunks:
        codec.decode_chunk(ch.blobs[0], paged)
    assert torch.equal(paged.gather(0, T), dense)


def test_registry_inspect_and_options(synthetic_kvt, coded):
    kv, codec, chunks = coded
    c = make_codec("transform-ans", transform=synthetic_kvt, chunk_tokens=64, bits_per_value=3.0, block=4096)
    assert c.id == codec.id and torch.equal(decode_all(c, chunks, kv), decode_all(codec, chunks, kv))
    info = c.inspect_chunk(chunks[1].blobs[0])
    assert (info.index, info.start_token, info.tokens, info.codec) == (1, 64, 64, codec.id)
    assert TransformAnsCodec(synthetic_kvt, lanes=64).id != TransformAnsCodec(synthetic_kvt).id
    for bad in ({"lanes": 3}, {"block": 100}, {"coder": "hevc"}):
        with pytest.raises(ConfigError):
            TransformAnsCodec(synthetic_kvt, **bad)


def _edit_header(blob: bytes, **fields) -> bytes:
    magic, version, n = struct.unpack_from("<4sHI", blob)
    h = json.loads(blob[10 : 10 + n]) | fields
    head = json.dumps(h, separators=(",", ":"), sort_keys=True).encode()
    return struct.pack("<4sHI", magic, version, len(head)) + head + struct.pack("<I", crc32(head)) + blob[14 + n :]


def test_damaged_forged_and_foreign_chunks_are_clear_errors(synthetic_kvt, coded, tmp_path):
    kv, codec, chunks = coded
    blob = chunks[0].blobs[0]
    out = torch.empty_like(kv[:, :, :64])
    cases = [
        (blob[:-5], TruncatedError),
        (blob[:-1] + bytes([blob[-1] ^ 1]), ChecksumError),
        (blob + b"x", FormatError),
        (_edit_header(blob, samples=12), FormatError),
        (_edit_header(blob, lanes=3), FormatError),
        (_edit_header(blob, ans_version=9), FormatError),
        (_edit_header(blob, extra=1), FormatError),
        (_edit_header(blob, escapes=10**9), FormatError),
        (
            TransformCodec(synthetic_kvt, chunk_tokens=64, coder="zstd").encode_chunks(kv[:, :, :64])[0].blobs[0],
            FormatError,
        ),
    ]
    for bad, err in cases:
        with pytest.raises(err):
            codec.decode_chunk(bad, out)
    with pytest.raises(KVCodecError):  # another chunk's length
        codec.decode_chunk(chunks[2].blobs[0], out)
    save_kvt(calibrate([synthetic_kv(600, s) for s in (5, 6)], ROPE), tmp_path / "other.kvt")
    with pytest.raises(ConfigError):
        TransformAnsCodec(tmp_path / "other.kvt", chunk_tokens=64).decode_chunk(blob, out)


def test_encode_decode_commands(synthetic_kvt, tmp_path):
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from kvcodec.cli.codec_cmds import decode_cmd, encode_cmd

    kv = synthetic_kv(200, seed=16)
    save_file({"kv": kv}, str(tmp_path / "in.safetensors"))
    args = [str(tmp_path / "in.safetensors"), str(tmp_path / "t.kvc"), "--transform", str(synthetic_kvt)]
    res = CliRunner().invoke(encode_cmd, [*args, "--sample-coder", "ans", "--chunk-tokens", "64"])
    assert res.exit_code == 0, res.output
    assert "transform-ans1-" in res.output
    dec = [str(tmp_path / "t.kvc"), str(tmp_path / "out.safetensors"), "--transform", str(synthetic_kvt)]
    res = CliRunner().invoke(decode_cmd, dec)
    assert res.exit_code == 0, res.output
    assert rel_mse(load_file(str(tmp_path / "out.safetensors"))["kv"], kv) < 0.05
    data = bytearray((tmp_path / "t.kvc").read_bytes())
    data[-3] ^= 0xFF
    (tmp_path / "bad.kvc").write_bytes(bytes(data))
    res = CliRunner().invoke(decode_cmd, [str(tmp_path / "bad.kvc"), *dec[1:]])
    assert res.exit_code != 0 and isinstance(res.exception, ChecksumError)
    res = CliRunner().invoke(encode_cmd, [args[0], str(tmp_path / "u.kvc"), "--sample-coder", "ans"])
    assert res.exit_code != 0 and "--transform" in res.output
