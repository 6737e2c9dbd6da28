"""GroupedCodec: several layer groups per chunk through a real inner codec (raw and HEVC), the
positions each group holds, old plain blobs, and damaged or mismatched input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.codecs import make_codec
from kvcodec.codecs.grouped import GroupedChunkInfo, GroupedCodec, is_grouped
from kvcodec.errors import ChecksumError, ConfigError, FormatError, KVCodecError, ShapeError
from kvcodec.kvspec import GroupedKV, KVSpec, LayerSpec

HYBRID = KVSpec(
    (
        LayerSpec("sliding", (2, 8), (2, 8), keep=7),
        LayerSpec("full", (2, 8), (2, 8)),
        LayerSpec("mla", (1, 16), (1, 8)),
        LayerSpec("sliding", (2, 8), (2, 8), keep=7),
    ),
    "bfloat16",
)


def _random(spec: KVSpec, stop: int, seed: int = 0) -> GroupedKV:
    torch.manual_seed(seed)
    kv = GroupedKV.empty(spec, stop, window=False)
    for t in kv.tensors:
        t.copy_(torch.randn(t.shape) * 3)
    return kv


def _restore(codec: GroupedCodec, chunks, spec: KVSpec, stop: int, resolution=None) -> GroupedKV:
    out = GroupedKV.empty(spec, stop)
    for ch in chunks:
        blob = ch.blobs[0] if resolution is None else ch.blob_for(resolution)
        codec.decode_chunk(blob, out.view(ch.start_token, ch.start_token + ch.tokens))
    return out


@pytest.mark.parametrize("stop", [5, 16, 23, 40])
def test_windowed_roundtrip_raw(stop):
    codec = GroupedCodec(make_codec("raw", variants=("raw", "zstd"), chunk_tokens=8))
    kv = _random(HYBRID, stop).prefix(stop)  # what a cache holds: sliding layers only their window
    chunks = codec.encode_chunks(kv)
    assert [c.start_token for c in chunks] == list(range(0, stop, 8))
    for res in codec.resolutions:
        assert _restore(codec, chunks, HYBRID, stop, res).equal(kv)
    # sliding parts appear only in chunks that hold window positions
    for ch in chunks:
        info = codec.inspect_chunk(ch.blobs[0])
        assert isinstance(info, GroupedChunkInfo) and info.spec == HYBRID
        held = {HYBRID.groups[p.group].name: (p.start, p.tokens) for p in info.parts}
        window_from = max(0, stop - 7)
        if ch.start_token + ch.tokens <= window_from:
            assert "sliding7-kv-2x8" not in held
        else:
            assert held["sliding7-kv-2x8"][0] == max(ch.start_token, window_from)


def test_exact_hevc_roundtrip_and_prefix_chunks():
    codec = GroupedCodec(make_codec("hevc", quant="exact", chunk_tokens=16))
    kv = _random(HYBRID, 40)  # full history (what the engine records for prefix reuse)
    chunks = codec.encode_chunks(kv, keys=["a", "b", "c"])
    assert [codec.inspect_chunk(c.blobs[0]).key for c in chunks] == ["a", "b", "c"]
    assert _restore(codec, chunks, HYBRID, 40).equal(kv.prefix(40))
    # a later prompt reuses the first two chunks: its sliding window lies inside them
    assert _restore(codec, chunks[:2], HYBRID, 32).equal(kv.prefix(32))
    # continuing from chunk 1 numbers chunks and positions from there
    tail = codec.encode_chunks(kv, first_chunk_index=1)
    assert [(c.index, c.start_token, c.tokens) for c in tail] == [(1, 16, 16), (2, 32, 8)]


def test_plain_tensors_and_old_blobs_go_through_the_inner_codec():
    inner = make_codec("raw", chunk_tokens=4)
    codec = GroupedCodec(inner)
    kv = torch.randn(3, 2, 10, 2, 4, dtype=torch.float16)
    old = inner.encode_chunks(kv)
    assert not is_grouped(old[0].blobs[0])
    out = torch.empty_like(kv)
    for ch in old:
        codec.decode_chunk(ch.blobs[0], out[:, :, ch.start_token : ch.start_token + ch.tokens])
    assert torch.equal(out, kv)
    target = GroupedKV.from_tensor(torch.empty_like(kv))
    for ch in codec.encode_chunks(kv):
        codec.decode_chunk(ch.blobs[0], target.view(ch.start_token, ch.start_token + ch.tokens))
    assert torch.equal(target.tensors[0], kv)
    with pytest.raises(ShapeError, match="several layer groups"):
        codec.decode_chunk(old[0].blobs[0], GroupedKV.empty(HYBRID, 4))


def test_damage_and_mismatches_are_clear_errors():
    codec = GroupedCodec(make_codec("raw", chunk_tokens=8))
    kv = _random(HYBRID, 16).prefix(16)
    blob = codec.encode_chunks(kv)[1].blobs[0]
    target = GroupedKV.empty(HYBRID, 16).view(8, 16)
    flipped = bytearray(blob)
    flipped[-3] ^= 0x10
    with pytest.raises(ChecksumError):
        codec.decode_chunk(bytes(flipped), target)
    with pytest.raises(FormatError):
        codec.inspect_chunk(blob[:-5])
    other = KVSpec(HYBRID.layers[:3], "bfloat16")
    with pytest.raises(ShapeError, match="4 layers, target 3"):
        codec.decode_chunk(blob, GroupedKV.empty(other, 16).view(8, 16))
    with pytest.raises(ShapeError, match="holds \\[8, 16\\)"):
        codec.decode_chunk(blob, GroupedKV.empty(HYBRID, 24).view(16, 24))
    # a target that wants sliding positions the chunk does not hold
    wide = GroupedKV.empty(HYBRID, 16, window=False).view(8, 16)
    with pytest.raises(ShapeError, match="needs them from 8"):
        codec.decode_chunk(blob, wide)
    with pytest.raises(KVCodecError):
        codec.encode_chunks(kv, keys=["only-one"])
    with pytest.raises(ShapeError):
        codec.encode_chunks([1, 2, 3])


def test_registered_by_name():
    from kvcodec.codecs import registered_codecs

    if "grouped" not in registered_codecs():
        pytest.skip("grouped codec not registered in this checkout")
    codec = make_codec("grouped", inner="raw", chunk_tokens=8)
    assert isinstance(codec, GroupedCodec) and codec.chunk_tokens == 8


def test_int8_groups_decode_as_the_inner_codec_decodes_them():
    """Lossy modes: each group restores to exactly what the inner codec gives for that group alone."""
    inner = make_codec("hevc", quant="int8", chunk_tokens=16)
    codec = GroupedCodec(inner)
    kv = _random(HYBRID, 20).prefix(20)
    got = _restore(codec, codec.encode_chunks(kv), HYBRID, 20)
    for g, t, s, out in zip(HYBRID.groups, kv.tensors, kv.starts, got.tensors):
        want = torch.empty_like(t)
        for c in range(0, 20, 16):  # the same chunk boundaries, from the group's first position
            a, b = max(c, s), min(c + 16, 20)
            if a < b:
                blob = inner.encode_chunks(t[:, :, a - s : b - s].contiguous())[0].blobs[0]
                inner.decode_chunk(blob, want[:, :, a - s : b - s])
        assert torch.equal(out, want), g.name
        assert (out.float() - t.float()).abs().max() < 0.1  # int8 of values within +-15


def test_per_kind_codecs_code_their_groups():
    from kvcodec.codecs.grouped import _parse
    from kvcodec.codecs.raw import MAGIC as RAW_MAGIC
    from kvcodec.codecs.raw import RawCodec
    from kvcodec.container.format import read_object

    plain, zstd, lz4 = RawCodec(chunk_tokens=8), RawCodec(("zstd",), chunk_tokens=8), RawCodec(("lz4",), chunk_tokens=8)
    plain_res = plain.resolutions
    zstd, lz4 = (dataclasses.replace(c, resolutions=plain_res) for c in (zstd, lz4))
    codec = GroupedCodec(plain, {"sliding": zstd, "mla-rope-1x4": lz4})
    assert codec.id != GroupedCodec(plain).id
    kv = _random(HYBRID, 16).prefix(16)
    chunks = codec.encode_chunks(kv)
    assert _restore(codec, chunks, HYBRID, 16).equal(kv)
    info, payload = _parse(chunks[1].blobs[0])
    offset, variants = 0, {}
    for p in info.parts:  # each part is a raw codec blob whose header names its payload coding
        header, _ = read_object(payload[offset : offset + p.length], RAW_MAGIC, "raw chunk")
        variants[HYBRID.groups[p.group].name] = header["variant"]
        offset += p.length
    assert variants == {"sliding7-kv-2x8": "zstd", "full-kv-2x8": "raw", "mla-latent-1x8": "raw", "mla-rope-1x4": "lz4"}
    with pytest.raises(ConfigError, match="16-token chunks"):
        GroupedCodec(plain, {"full": RawCodec(chunk_tokens=16, resolutions=plain_res)})


@st.composite
def _hybrid_specs(draw):
    layers = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["full", "sliding", "mla"]))
        if kind == "mla":
            layers.append(LayerSpec("mla", (1, draw(st.sampled_from([4, 8]))), (1, 2)))
        else:
            shape = (draw(st.integers(1, 2)), draw(st.sampled_from([2, 4])))
            layers.append(LayerSpec(kind, shape, shape, draw(st.integers(1, 9)) if kind == "sliding" else None))
    return KVSpec(tuple(layers), draw(st.sampled_from(["float16", "bfloat16", "float32"])))


@settings(max_examples=40, deadline=None)
@given(spec=_hybrid_specs(), stop=st.integers(1, 30), ct=st.integers(1, 9), data=st.data())
def test_any_chunk_aligned_prefix_restores_exactly(spec, stop, ct, data):
    codec = GroupedCodec(make_codec("raw", chunk_tokens=ct))
    kv = GroupedKV.empty(spec, stop, window=False)
    for t in kv.tensors:
        t.copy_(torch.randn(t.shape))
    chunks = codec.encode_chunks(kv)
    n = data.draw(st.integers(1, len(chunks)))
    prefix = min(stop, n * ct)
    got = _restore(codec, chunks[:n], spec, prefix)
    assert got.equal(kv.prefix(prefix))
    first = data.draw(st.integers(0, len(chunks) - 1))  # re-encoding from a later chunk gives the same blobs
    tail = codec.encode_chunks(kv, first_chunk_index=first)
    assert [c.blobs for c in tail] == [c.blobs for c in chunks[first:]]


def test_transform_codecs_calibrated_per_layer_kind():
    """A TransformCodec calibrated on each kind's group tensors codes that kind's groups."""
    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.transform.calibration import calibrate
    from kvcodec.transform.kvt import kvt_hash, to_bytes

    spec = KVSpec(
        (
            LayerSpec("sliding", (2, 8), (2, 8), keep=40),
            LayerSpec("full", (2, 8), (2, 8)),
            LayerSpec("full", (2, 8), (2, 8)),
        ),
        "float32",
    )
    calib = _random(spec, 256, seed=1)  # calibration data differs from the data coded below
    per_kind = {}
    for g, t in zip(spec.groups, calib.tensors):
        cal = calibrate([t], None, sink_tokens=0)
        per_kind[g.kind] = TransformCodec(
            cal, kvt_hash=kvt_hash(to_bytes(cal)), bits_per_value=4, coder="zstd", chunk_tokens=32, fine_tokens=0
        )  # fine_tokens=0: the grouped codec codes chunk by chunk, a finer tail would end each chunk
    codec = GroupedCodec(per_kind["full"], {"sliding": per_kind["sliding"]})
    kv = _random(spec, 70, seed=2)
    got = _restore(codec, codec.encode_chunks(kv), spec, 70)
    for g, t, out, start in zip(spec.groups, kv.tensors, got.tensors, got.starts):  # sliding: its window
        alone = per_kind[g.kind]
        want = torch.empty_like(t)
        for c in alone.encode_chunks(t):
            alone.decode_chunk(c.blobs[0], want[:, :, c.start_token : c.start_token + c.tokens])
        assert torch.equal(out, want[:, :, start:]), g.name
        assert (out - t[:, :, start:]).pow(2).mean() < 0.05 * t.pow(2).mean()  # 4 bits per value


def test_headers_parsed_once_share_the_models_spec_and_still_check_each_blobs_payload():
    """A chunk's header is parsed once and kept by its bytes (a fetch reads it twice); every kept header holds the
    same KVSpec object, and a blob cut short behind a kept header is still refused."""
    from kvcodec.codecs.grouped import chunk_info

    codec = GroupedCodec(make_codec("raw", chunk_tokens=8))
    blobs = [c.blobs[0] for c in codec.encode_chunks(_random(HYBRID, 24).prefix(24))]
    infos = [chunk_info(b) for b in blobs]
    assert chunk_info(blobs[1]) is infos[1] and infos[0].spec is infos[2].spec == HYBRID
    with pytest.raises(KVCodecError, match="payload"):
        chunk_info(blobs[1][:-5])


def test_a_header_padded_past_the_kept_size_is_read_but_not_kept():
    """A store that pads headers (valid JSON, whitespace) cannot fill memory through the parsed-header cache."""
    import json
    import struct

    from kvcodec.codecs.grouped import MAGIC, chunk_info
    from kvcodec.container import format as fmt

    codec = GroupedCodec(make_codec("raw", chunk_tokens=8))
    blob = codec.encode_chunks(_random(HYBRID, 8).prefix(8))[0].blobs[0]
    header, payload = fmt.read_object(blob, MAGIC, "grouped chunk")
    head = json.dumps(header).encode() + b" " * fmt.MAX_KEPT_HEADER_BYTES
    padded = struct.pack("<4sHI", MAGIC, fmt.FORMAT_VERSION, len(head)) + head + struct.pack("<I", fmt.crc32(head))
    want = chunk_info(blob)
    kept = fmt._parsed.cache_info().currsize
    assert chunk_info(padded + bytes(payload)) == want
    assert fmt._parsed.cache_info().currsize == kept
