"""`kvcodec inspect` over every file format kvcodec writes (codecs/describe.py): HEVC .kvc (KVCF,
split-stream chunks too), transform files (KVTF, transform and transform-ans chunks) and grouped
files (KVGF), each made by its real encoder, and one chunk blob of each (KVCS, KVTC, KVTA, KVCG) as a
store holds it (and a raw codec chunk, KVRW); damaged, truncated and foreign data is one clear error."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import kvcodec
from kvcodec.cli.main import cli
from kvcodec.codecs import make_codec
from kvcodec.codecs.describe import CORE, READERS, describe
from kvcodec.codecs.grouped import GroupedCodec
from kvcodec.codecs.grouped_file import encode_grouped
from kvcodec.codecs.transform.codec import TransformCodec
from kvcodec.codecs.transform.file import encode_file
from kvcodec.codecs.transform_ans import TransformAnsCodec
from kvcodec.container.format import crc32, read_object, write_object
from kvcodec.errors import ChecksumError, FormatError, TruncatedError
from synthetic import synthetic_kv
from test_grouped_file import _kv


def _hevc(synthetic_kvt):  # noqa: ANN001, ANN202
    kv = (torch.randn(4, 2, 40, 2, 64) * 2).half()
    codec = make_codec(
        "hevc", quant="int8", chunk_tokens=32, resolutions=((144, 144),), streams_per_chunk=2, sample_coder="hevc"
    )
    return kvcodec.encode(kv, codec.config), codec, kv.shape[2]


def _transform(synthetic_kvt, cls=TransformCodec, **kw):  # noqa: ANN001, ANN202
    codec = cls(synthetic_kvt, chunk_tokens=64, resolutions=((64, 64),), **kw)
    return encode_file(synthetic_kv(150, seed=7), codec), codec, 150


def _grouped(synthetic_kvt):  # noqa: ANN001, ANN202
    codec = GroupedCodec(make_codec("raw", chunk_tokens=8, variants=("raw", "zstd")))
    return encode_grouped(_kv(21), codec), codec, 21


FILES = {
    "hevc-split": _hevc,
    "transform-hevc": lambda synthetic_kvt: _transform(synthetic_kvt, coder="hevc"),
    "transform-zstd": lambda synthetic_kvt: _transform(synthetic_kvt, coder="zstd"),
    "transform-mixed": lambda synthetic_kvt: _transform(synthetic_kvt, coder="mixed"),
    "transform-ans": lambda synthetic_kvt: _transform(synthetic_kvt, TransformAnsCodec, block=4096),
    "grouped": _grouped,
}


@pytest.fixture(scope="module", params=list(FILES))
def made(request, synthetic_kvt):
    return request.param, *FILES[request.param](synthetic_kvt)


def _inspect(tmp_path, data: bytes, *args: str):  # noqa: ANN202
    path = tmp_path / "f.kvc"
    path.write_bytes(data)
    return CliRunner().invoke(cli, ["inspect", str(path), *args])


def test_inspect_describes_every_format(made, synthetic_kvt, tmp_path):
    name, data, codec, tokens = made
    r = _inspect(tmp_path, data, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert set(CORE) <= set(info) and info["magic"].encode() in READERS
    assert info["codec"] == codec.id and info["tokens"] == tokens and info["file_bytes"] == len(data)
    assert info["chunks"] == -(-tokens // codec.chunk_tokens)
    assert info["ratio_vs_fp16"] == pytest.approx(info["fp16_bytes"] / len(data))
    assert set(info["chunk_bytes"]) == {f"{w}x{h}" for w, h in codec.resolutions}
    sizes = [n for per_res in info["chunk_bytes"].values() for n in per_res]
    assert len(sizes) == info["chunks"] * len(codec.resolutions) and sum(sizes) < len(data)
    text = _inspect(tmp_path, data).output
    assert f"{info['format']} v{info['version']}" in text and codec.id in text, text
    if name.startswith("transform"):
        assert info["kvt"] == codec.kvt_hash and f"calibration {codec.kvt_hash}" in text
        assert info["coder"] == name.removeprefix("transform-") and info["dtype"] == "float16"
        assert len(info["chunk_theta"]) == info["chunks"] and info["settings"]["chunk_tokens"] == 64
    if name == "hevc-split":
        assert info["resolutions"]["144x144"]["parts"][0]["layers"] == 2 and "part 1: layers 2-3" in text
    if name == "grouped":
        assert len(info["groups"]) == 4 and info["groups"][3] | {"layers": [2], "start": 0} == info["groups"][3]
        assert "group       sliding9-kv-2x8: layers 0, from position 12" in text


def test_damaged_truncated_and_foreign_files_are_clear_errors(made, tmp_path):
    _, data, _, _ = made
    flipped = bytearray(data)
    flipped[-3] ^= 0x10  # a byte of the last chunk's payload
    head = bytearray(data)
    head[20] ^= 0x01  # a byte of the header
    cases = [
        (bytes(flipped), ChecksumError),
        (bytes(head), ChecksumError),
        (data[:-1], TruncatedError),
        (data[:30], TruncatedError),
        (data[:2], TruncatedError),
        (data + b"\0", FormatError),
        (b"PK\x03\x04" + data[4:], FormatError),
        (b"", FormatError),
    ]
    for bad, error in cases:
        with pytest.raises(error):
            describe(bad)
        r = _inspect(tmp_path, bad)
        assert r.exit_code == 1 and r.output.startswith("error: ") and "Traceback" not in r.output, r.output


CHUNK_MAGIC = {
    "hevc-split": "KVCS",
    "transform-hevc": "KVTC",
    "transform-zstd": "KVTC",
    "transform-mixed": "KVTC",
    "transform-ans": "KVTA",
}


def test_inspect_describes_a_chunk_blob_as_a_store_holds_it(made, tmp_path):
    name, data, codec, tokens = made
    start = 10 + int.from_bytes(data[6:10], "little") + 4  # the payload: the first chunk's first blob
    blob = data[start : start + next(iter(describe(data)["chunk_bytes"].values()))[0]]
    info = describe(blob)
    assert set(CORE) <= set(info) and info["magic"] == CHUNK_MAGIC.get(name, "KVCG"), info
    assert (info["chunks"], info["chunk_index"], info["start_token"]) == (1, 0, 0) and info["key"].endswith(
        f"/0/{-(-tokens // codec.chunk_tokens)}"
    )
    assert info["tokens"] == min(codec.chunk_tokens, tokens) and info["file_bytes"] == len(blob)
    r = _inspect(tmp_path, blob)
    assert r.exit_code == 0 and f"chunk       0: tokens 0-{info['tokens'] - 1} " in r.output, r.output
    if name in ("transform-hevc", "transform-mixed"):  # chunk 0 is video: each frame a stream of its own
        assert len(info["pieces"]) == info["frames"] > 1 and sum(info["pieces"]) == info["streams"]["video"]
        assert f"video       {info['frames']} frames, each a stream of its own" in r.output, r.output
    if name == "hevc-split":  # the second chunk (8 tokens) is stored plain, not split
        plain = describe(data[start + len(blob) :][: describe(data)["chunk_bytes"]["144x144"][1]])
        assert (plain["magic"], plain["quant"], plain["start_token"], plain["tokens"]) == ("KVCC", "plain", 32, 8)
    flipped = bytearray(blob)
    flipped[-2] ^= 0x08
    for bad, error in ((bytes(flipped), ChecksumError), (blob[:-1], TruncatedError), (blob[:12], TruncatedError)):
        with pytest.raises(error):
            describe(bad)


def test_a_version_1_transform_file_is_described_from_its_chunks(synthetic_kvt, tmp_path):
    data, codec, _ = _transform(synthetic_kvt, coder="hevc")  # version 1 had no mixed coder
    h, payload = read_object(data, b"KVTF", "file")
    blobs, pos = [], 0
    for _, length, _ in h["chunks"]:
        ch, part = read_object(payload[pos : pos + length], b"KVTC", "chunk")
        blobs.append(write_object(b"KVTC", {**ch, "key": None}, [bytes(part)]))  # version 1 chunks carry no key
        pos += length
    v2 = describe(data)
    old = {k: v for k, v in h.items() if k not in ("format", "kvtf_version", "settings", "file_id")}
    old["chunks"] = [[t, len(b), crc32(b)] for (t, _, _), b in zip(h["chunks"], blobs)]
    info = describe(write_object(b"KVTF", old, blobs))
    assert info["version"] == 1 and info["settings"] == {k: v2["settings"][k] for k in info["settings"]}
    assert set(info["settings"]) == set(v2["settings"]) and info["chunk_theta"] == v2["chunk_theta"]
    path = tmp_path / "v1.kvc"
    path.write_bytes(write_object(b"KVTF", old, blobs))
    r = CliRunner().invoke(cli, ["inspect", str(path)])
    assert r.exit_code == 0 and "v1)" in r.output and "4 sink tokens fp16, last 16 tokens 2^2 finer" in r.output, (
        r.output
    )


def test_a_raw_codec_chunk_is_described(tmp_path):
    chunks = make_codec("raw", chunk_tokens=8, variants=("zstd",)).encode_chunks(torch.randn(2, 2, 20, 2, 8).half())
    blob = chunks[1].blobs[0]
    info = describe(blob)
    assert set(CORE) <= set(info) and info["magic"] == "KVRW" and info["codec"] == "raw"
    assert (info["start_token"], info["tokens"], info["chunk_bytes"]) == (8, 8, {"zstd": [len(blob)]})
    assert "chunk       1: tokens 8-15 (8) of 2x2x8 float16" in _inspect(tmp_path, blob).output
    with pytest.raises(ChecksumError):
        describe(blob[:-1] + bytes([blob[-1] ^ 1]))


def test_inspect_describes_a_kvt_its_fit_and_its_held_out_quality(tmp_path):
    """A .kvt with a quality report (as calibrate writes it): its sha256 (what codec ids and chunks
    carry), shape and groups, what it was fitted on, the fallback and report lines, the safe ratio
    its report gives (quality.safe_ratio: 5x passes, 8x fails)."""
    from kvcodec.transform import calibrate, save_kvt
    from kvcodec.transform.kvt import kvt_hash
    from synthetic import ROPE

    report = {
        "metric": "model",
        "held_out": ["pg/held"],
        "points": [
            {"target": 5.0, "ratio": 4.9, "top1": 0.995, "ppl_delta_pct": 0.1},
            {"target": 8.0, "ratio": 7.8, "top1": 0.97, "ppl_delta_pct": 0.9},
        ],
    }
    info = {"model": "synthetic", "sources": ["pg/a", "pg/b"], "fallback": ["g0.v"], "quality": report}
    cal = calibrate([synthetic_kv(600, s) for s in (1, 2)], ROPE, info=info)
    path = tmp_path / "m.kvt"
    digest = save_kvt(cal, path)
    r = CliRunner().invoke(cli, ["inspect", str(path), "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    assert got["sha256"] == digest == kvt_hash(path.read_bytes()) and got["file_bytes"] == path.stat().st_size
    assert got["shape"] == [cal.layers, cal.kv_heads, cal.head_dim] and got["groups"] == [list(g) for g in cal.groups]
    assert got["safe_ratio"] == 5.0 and got["fallback"] == ["g0.v"] and got["rope"]["theta"] == ROPE.theta
    text = CliRunner().invoke(cli, ["inspect", str(path)]).output
    assert f"sha256      {digest}" in text and "fitted on   pg/a, pg/b" in text and "plain MSE" in text
    assert "fallback    g0.v" in text and "held out    pg/held: 5x top-1 0.995 ppl +0.10%; 8x" in text
    assert "safe ratio  5x" in text


def test_inspect_of_a_kvt_without_a_report_or_truncated(synthetic_kvt, tmp_path):
    text = CliRunner().invoke(cli, ["inspect", str(synthetic_kvt)]).output
    assert "held out    nothing" in text and "model       synthetic" in text, text
    data = synthetic_kvt.read_bytes()
    bad = tmp_path / "bad.kvt"
    bad.write_bytes(data[: len(data) // 2])
    r = CliRunner().invoke(cli, ["inspect", str(bad)])
    assert r.exit_code == 1 and r.output.startswith("error: ") and ".kvt" in r.output, r.output


def test_inspect_describes_a_kv_file_of_extract(tmp_path):
    from kvcodec.kvspec.files import save_kv_file

    path = tmp_path / "kv.safetensors"
    save_kv_file(path, synthetic_kv(40, 3), {"model": "synthetic", "text": "pg/a", "input_ids": "[1, 2]"})
    r = CliRunner().invoke(cli, ["inspect", str(path), "--json"])
    got = json.loads(r.output)
    assert got["tokens"] == 40 and got["tensors"] == {"kv": list(synthetic_kv(40, 3).shape)} and "input_ids" not in got
    text = CliRunner().invoke(cli, ["inspect", str(path)]).output
    assert "40 tokens" in text and "model       synthetic" in text and "text        pg/a" in text
