"""Round trips through the real x265 encoder and FFmpeg decoder, and bad input."""

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcodec
from kvcodec import CodecConfig
from kvcodec.codec import decode_chunk_blob, encode_chunks, inspect_chunk_blob
from kvcodec.errors import ChecksumError, ConfigError, CorruptStreamError, FormatError, ShapeError, TruncatedError

SMALL = ((144, 144),)
_INT = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def kv_like(layers=2, tokens=40, heads=2, dim=32, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.05, 4.0, dim)
    kv = torch.randn(layers, 2, tokens, heads, dim, generator=g) * scale
    kv[:, 0, 0] *= 20  # an attention-sink-like outlier token
    return kv.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_exact_restores_every_bit(dtype):
    kv = kv_like(dtype=dtype)
    kv.view(-1)[5] = float("nan")
    kv.view(-1)[6] = -0.0
    out = kvcodec.decode(kvcodec.encode(kv, CodecConfig(quant="exact", chunk_tokens=16, resolutions=SMALL)))
    assert out.dtype == dtype and out.shape == kv.shape
    assert torch.equal(out.view(_INT[dtype]), kv.view(_INT[dtype]))


@pytest.mark.parametrize("quant", ["int8", "int5", "int2"])
@pytest.mark.parametrize("coder", ["hevc", "zstd"])
def test_integer_modes_restore_the_encoded_integers_within_half_a_step(quant, coder):
    from kvcodec.quant import integer

    kv = kv_like(tokens=33)
    config = CodecConfig(quant=quant, chunk_tokens=33, resolutions=SMALL, sample_coder=coder)
    out = kvcodec.decode(kvcodec.encode(kv, config))
    bits = torch.full((kv.shape[0],), config.bits)
    offset, step = integer.minmax_params(kv, bits)
    q = integer.quantize(kv, offset, step, bits)
    # the decoded values are exactly the dequantized encoded integers ...
    assert torch.equal(out, integer.dequantize(q, offset, step, kv.dtype))
    # ... and within half a step (plus fp16 output rounding) of the input
    err = (out.float() - kv.float()).abs()
    bound = step.float().unsqueeze(2) / 2 + kv.float().abs() * 2**-10
    assert (err <= bound * 1.001).all()
    assert err.max() > 0 or quant == "int8"


def test_layer_wise_bits():
    kv = kv_like(layers=3)
    config = CodecConfig(quant="int4", layer_bits=(8, 4, 2), chunk_tokens=64, resolutions=SMALL)
    out = kvcodec.decode(kvcodec.encode(kv, config))
    errs = [(out[i].float() - kv[i].float()).abs().mean().item() for i in range(3)]
    assert errs[0] < errs[1] < errs[2]
    header = kvcodec.inspect_chunk_blob(encode_chunks(kv, config)[0].blobs[0])
    assert header.layer_bits == (8, 4, 2)


def test_chunks_are_independently_decodable_at_every_resolution():
    kv = kv_like(tokens=50)
    config = CodecConfig(quant="int8", chunk_tokens=16, resolutions=((144, 144), (256, 160)))
    chunks = encode_chunks(kv, config)
    assert [c.tokens for c in chunks] == [16, 16, 16, 2]
    whole = kvcodec.decode(kvcodec.encode(kv, config))
    for c in chunks:
        assert len(c.blobs) == 2
        a = decode_chunk_blob(c.blobs[0])
        b = decode_chunk_blob(c.blob_for((256, 160)))
        assert torch.equal(a, b)
        assert torch.equal(a, whole[:, :, c.start_token : c.start_token + c.tokens])
        assert inspect_chunk_blob(c.blobs[1]).resolution == (256, 160)


def test_decode_into_a_slice_of_a_preallocated_cache():
    kv = kv_like(tokens=20)
    config = CodecConfig(quant="exact", chunk_tokens=20, resolutions=SMALL)
    (chunk,) = encode_chunks(kv, config)
    cache = torch.zeros(2, 2, 64, 2, 32, dtype=torch.float16)
    got = decode_chunk_blob(chunk.blobs[0], out=cache[:, :, 10:30])
    assert got.data_ptr() == cache[:, :, 10:30].data_ptr()
    assert torch.equal(cache[:, :, 10:30], kv) and (cache[:, :, :10] == 0).all()
    with pytest.raises(ShapeError):
        decode_chunk_blob(chunk.blobs[0], out=cache[:, :, 0:19])


def test_inspect_reports_sizes_and_ratio():
    kv = kv_like()
    info = kvcodec.inspect(
        kvcodec.encode(kv, CodecConfig(quant="int4", chunk_tokens=16, resolutions=SMALL, plain_fallback=False))
    )
    res = info["resolutions"]["144x144"]
    assert info["shape"] == list(kv.shape) and info["chunks"] == 3
    assert res["ratio_vs_fp16"] == pytest.approx(info["fp16_bytes"] / res["bytes"])
    assert set(res["streams"]) in (
        {"side", "center", "video"},
        {"side", "center", "low", "video"},
        {"side", "center", "samples"},
    )


@pytest.mark.parametrize(
    "bad, error",
    [
        (torch.zeros(2, 3, 4, 1, 8), ShapeError),  # K/V axis is not 2
        (torch.zeros(2, 2, 4, 8), ShapeError),  # 4-D
        (torch.zeros(2, 2, 4, 1, 8, dtype=torch.int32), ShapeError),
        (torch.full((1, 2, 4, 1, 8), float("nan")), ShapeError),  # NaN cannot be quantized
    ],
)
def test_bad_tensors_are_refused_clearly(bad, error):
    with pytest.raises(error):
        kvcodec.encode(bad, CodecConfig(resolutions=SMALL))


def test_bad_configs_are_refused_clearly():
    with pytest.raises(ConfigError, match="quant"):
        CodecConfig(quant="int9")
    with pytest.raises(ConfigError, match="multiples of 16"):
        CodecConfig(resolutions=((150, 150),))
    with pytest.raises(ShapeError, match="layer_bits"):
        kvcodec.encode(kv_like(layers=2), CodecConfig(quant="int4", layer_bits=(4,), resolutions=SMALL))


@pytest.fixture(scope="module")
def encoded():
    kv = kv_like(tokens=24)
    return kv, kvcodec.encode(kv, CodecConfig(quant="int8", chunk_tokens=12, resolutions=SMALL))


def test_decode_reads_a_frame_size_as_text_and_refuses_wrong_arguments_by_name(encoded):
    kv, data = encoded
    (w, h), (one,) = SMALL[0], SMALL
    assert torch.equal(kvcodec.decode(data, resolution=f"{w}x{h}"), kvcodec.decode(data, resolution=one))
    with pytest.raises(ConfigError, match="decoded from its bytes"):  # a path: was a TypeError from memoryview
        kvcodec.decode("some.kvc")
    with pytest.raises(ConfigError, match="device must be cpu or a CUDA device"):  # was torch's RuntimeError
        kvcodec.decode(data, device="bogus")
    with pytest.raises(ConfigError, match="one frame size"):
        kvcodec.decode(data, resolution=f"{w}x{h},{w}x{h}")


def test_every_truncation_raises_a_kvcodec_error(encoded):
    _, data = encoded
    cuts = sorted({1, 3, 8, 10, 50, len(data) // 3, len(data) // 2, len(data) - 1} | set(range(0, 12)))
    for cut in cuts:
        with pytest.raises(FormatError):
            kvcodec.decode(data[:cut])
    with pytest.raises(TruncatedError):
        kvcodec.decode(data[: len(data) - 1])


def test_bit_flips_anywhere_are_detected(encoded):
    _, data = encoded
    step = max(1, len(data) // 97)
    for pos in range(0, len(data), step):
        flipped = bytearray(data)
        flipped[pos] ^= 0x10
        with pytest.raises(FormatError):
            kvcodec.decode(bytes(flipped))


def test_foreign_and_future_files_are_named(encoded):
    kv, data = encoded
    with pytest.raises(FormatError, match="not a kvcodec"):
        kvcodec.decode(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)
    future = bytearray(data)
    future[4] = 9
    with pytest.raises(FormatError, match="version 9"):
        kvcodec.decode(bytes(future))
    chunk = encode_chunks(kv, CodecConfig(quant="int8", chunk_tokens=12, resolutions=SMALL))[0].blobs[0]
    with pytest.raises(FormatError, match="chunk blob"):
        kvcodec.decode(chunk)  # a chunk blob is not a file
    with pytest.raises(ChecksumError):
        bad = bytearray(chunk)
        bad[-5] ^= 1
        decode_chunk_blob(bytes(bad))


@pytest.mark.parametrize("quant", ["int8", "int6", "exact"])
def test_every_video_bits_split_decodes_to_the_same_values(quant):
    kv = kv_like(tokens=37)
    ref = None
    sizes = {}
    for video_bits in (8, 5, 3, 1):
        config = CodecConfig(
            quant=quant, chunk_tokens=16, resolutions=SMALL, video_bits=video_bits, plain_fallback=False
        )
        data = kvcodec.encode(kv, config)
        out = kvcodec.decode(data)
        streams = kvcodec.inspect(data)["resolutions"]["144x144"]["streams"]
        sizes[video_bits] = streams
        assert ("low" in streams) == (video_bits < 8)
        if quant == "exact":
            assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
        ref = out if ref is None else ref
        assert torch.equal(out, ref), f"video_bits={video_bits} restores other values than video_bits=8"


def test_auto_video_bits_is_recorded_in_every_chunk_header():
    kv = kv_like(tokens=40)
    config = CodecConfig(quant="int8", chunk_tokens=16, resolutions=SMALL, plain_fallback=False)  # all coded
    chunks = encode_chunks(kv, config)
    bits = {inspect_chunk_blob(c.blobs[0]).video_bits for c in chunks}
    assert len(bits) == 1 and 1 <= bits.pop() <= 8


@pytest.mark.parametrize("bad", [0, 9, "4", 2.5, True])
def test_video_bits_is_validated(bad):
    with pytest.raises(ConfigError):
        CodecConfig(video_bits=bad)


def test_version_1_chunk_blobs_still_decode():
    import json
    import struct

    from kvcodec.container.format import crc32

    kv = kv_like(tokens=20)
    (chunk,) = encode_chunks(kv, CodecConfig(quant="int8", chunk_tokens=20, resolutions=SMALL, video_bits=8))
    blob = chunk.blobs[0]
    magic, _, head_len = struct.unpack_from("<4sHI", blob, 0)
    header = json.loads(blob[10 : 10 + head_len])
    del header["video_bits"]  # a version 1 writer knew no such field
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    v1 = struct.pack("<4sHI", magic, 1, len(head)) + head + struct.pack("<I", crc32(head)) + blob[10 + head_len + 4 :]
    assert torch.equal(decode_chunk_blob(v1), decode_chunk_blob(blob))
    assert inspect_chunk_blob(v1).video_bits == 8


def test_corrupted_low_bit_stream_is_refused():
    kv = kv_like(tokens=20)
    (chunk,) = encode_chunks(
        kv, CodecConfig(quant="int8", chunk_tokens=20, resolutions=SMALL, video_bits=4, plain_fallback=False)
    )
    header = inspect_chunk_blob(chunk.blobs[0])
    names = [s.name for s in header.streams]
    assert "low" in names
    start = len(chunk.blobs[0]) - header.payload_bytes + sum(s.length for s in header.streams[: names.index("low")])
    bad = bytearray(chunk.blobs[0])
    bad[start + 3] ^= 0x10
    with pytest.raises(ChecksumError, match="low"):
        decode_chunk_blob(bytes(bad))
    with pytest.raises(TruncatedError):
        decode_chunk_blob(chunk.blobs[0][: start + 5])


def _with_stream(blob: bytes, name: str, data: bytes) -> bytes:
    """`blob` with stream `name` replaced by `data`, lengths and checksums made consistent."""
    from kvcodec.container.format import CHUNK_MAGIC, crc32, parse_chunk, split_streams, write_object

    h, payload = parse_chunk(blob)
    streams = split_streams(payload, h.streams, "test")
    header, parts = h.to_json(), []
    for s in header["streams"]:
        piece = data if s["name"] == name else bytes(streams[s["name"]])
        s["length"], s["crc32"] = len(piece), crc32(piece)
        parts.append(piece)
    return write_object(CHUNK_MAGIC, header, parts)


@pytest.fixture(scope="module")
def split_chunk():
    config = CodecConfig(quant="int8", chunk_tokens=20, resolutions=SMALL, video_bits=4, plain_fallback=False)
    (chunk,) = encode_chunks(kv_like(tokens=20), config)
    return chunk.blobs[0]


def test_a_blob_decodes_from_any_buffer_and_is_never_written(split_chunk):
    want = decode_chunk_blob(split_chunk)
    inside = bytearray(b"x" * 7 + split_chunk + b"y" * 5)
    kept = bytes(inside)
    for blob in (bytearray(split_chunk), memoryview(inside)[7:-5], memoryview(split_chunk)):
        assert torch.equal(decode_chunk_blob(blob), want)
        assert inspect_chunk_blob(blob) == inspect_chunk_blob(split_chunk)
    assert bytes(inside) == kept


@pytest.mark.parametrize(
    "stream, data, match",
    [
        ("center", lambda n: zstandard.ZstdCompressor().compress(bytes(n - 1)), "channel centers"),
        ("center", lambda n: zstandard.ZstdCompressor().compress(bytes(n + 1)), "channel centers"),
        ("center", lambda n: b"not zstd at all", "does not decompress"),
        ("side", lambda n: zstandard.ZstdCompressor().compress(bytes(7)), "quantization parameters"),
        ("low", lambda n: bytes(n - 1), "holds"),
        ("low", lambda n: bytes(n + 8), "holds"),
    ],
)
def test_streams_of_the_wrong_size_are_refused(split_chunk, stream, data, match):
    from kvcodec.container.format import parse_chunk, split_streams

    h, payload = parse_chunk(split_chunk)
    raw = split_streams(payload, h.streams, "test")[stream]
    size = len(raw) if stream == "low" else len(zstandard.ZstdDecompressor().decompress(bytes(raw)))
    with pytest.raises(CorruptStreamError, match=match):
        decode_chunk_blob(_with_stream(split_chunk, stream, data(size)))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_host_shift_is_the_uncenter_shift(data):
    """The restore's per-channel shift, computed on the host from the centers, equals
    centering.uncenter_terms' (what the encoder's centering inverts)."""
    import numpy as np

    from kvcodec.codecs.hevc.decode import shift_from_centers
    from kvcodec.quant import centering

    units, dim = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 16))
    bits = torch.tensor(data.draw(st.lists(st.integers(2, 8), min_size=units, max_size=units)))
    modulus = 2**bits
    centers = torch.tensor(
        [[data.draw(st.integers(0, int(m) - 1)) for _ in range(dim)] for m in modulus], dtype=torch.uint8
    )
    shift, _ = centering.uncenter_terms(centers, modulus)
    got = shift_from_centers(centers.numpy(), (modulus // 2).numpy())
    assert np.array_equal(got, shift.squeeze(1).numpy())


def test_close_idle_lets_go_of_the_idle_decoders_and_keeps_the_lent_ones():
    from kvcodec.codecs.hevc.decode import _IdleDecoders

    idle = _IdleDecoders()
    with idle.borrow("cpu") as outer:
        with idle.borrow("cpu") as inner:  # both busy: a second decoder
            assert inner is not outer
        assert idle.close_idle() == 1  # inner, given back; outer is still lent
    with idle.borrow("cpu") as again:
        assert again is outer  # given back after the close, kept
    assert idle.close_idle() == 1 and idle.close_idle() == 0
    with idle.borrow("cpu") as fresh:
        assert fresh is not outer and fresh.name == outer.name
