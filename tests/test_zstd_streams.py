"""zstd streams of independent frames with a seek table (zstd's seekable format): the table's bytes,
round trips, damage refused by name, older single-frame streams still read, older readers refusing
the new streams, and reads from many threads at once (no timing: joins only)."""

from __future__ import annotations

import dataclasses
import functools
import shutil
import struct
import subprocess
import threading

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcodec
from kvcodec import CodecConfig
from kvcodec.codec import decode_chunk_blob, encode_chunks
from kvcodec.codecs import zstd_streams as zs
from kvcodec.codecs.hevc import encode as hevc_encode
from kvcodec.codecs.transform import codec as transform_codec
from kvcodec.codecs.transform.codec import TransformCodec
from kvcodec.codecs.transform.decode import unzstd
from kvcodec.container.format import CHUNK_MAGIC, StreamEntry, crc32, parse_chunk, split_streams, write_object
from kvcodec.errors import CorruptStreamError

U32 = st.integers(0, 2**32 - 1)
DATA = st.binary(max_size=6000) | st.builds(lambda n, b: bytes([b]) * n, st.integers(0, 9000), st.integers(0, 255))
FRAME_BYTES = st.integers(1, 3000)


def _noisy(n: int, seed: int = 0) -> bytes:
    """int8-like samples: compressible, but not to nothing."""
    rng = np.random.default_rng(seed)
    return rng.normal(128, 12, n).clip(0, 255).astype(np.uint8).tobytes()


def _read(data, size: int, name: str = "samples") -> tuple[int, bytes]:
    buf = np.full(size, 0xAB, dtype=np.uint8)
    return zs.unzstd_into(data, buf, name), buf.tobytes()


def _never_wrong(stream, data: bytes, name: str = "samples") -> None:
    """A damaged stream is refused by name, or decodes to a size other than the data's (which the
    callers refuse), or decodes to the data itself: never wrong data of the right size."""
    try:
        got, out = _read(stream, len(data), name)
    except CorruptStreamError as e:
        assert repr(name) in str(e)
        return
    assert got != len(data) or out == data


def _old_unzstd_into(data, buf: np.ndarray, name: str) -> int:
    """The reader before seek tables (one zstd frame read as far as buf holds), kept verbatim."""
    dctx = zstandard.ZstdDecompressor()
    view, got = memoryview(buf).cast("B"), 0
    try:
        with dctx.stream_reader(data) as reader:
            while got < buf.size:
                n = reader.readinto(view[got:])
                if not n:
                    return got
                got += n
            return got + len(reader.read(1))
    except zstandard.ZstdError as e:
        raise CorruptStreamError(f"stream {name!r} does not decompress: {e}") from e


# the seek table's bytes


@given(st.lists(st.tuples(U32, U32), max_size=40))
def test_a_seek_table_parses_back_to_its_frames(frames):
    table = zs.SeekTable(tuple(frames))
    raw = zs.seek_table_bytes(table)
    assert len(raw) == table.size == 17 + 8 * len(frames)
    assert zs.parse_seek_table(raw, "s") == table


def test_a_seek_table_is_laid_out_as_the_seekable_format_says():
    raw = zs.seek_table_bytes(zs.SeekTable(((10, 20), (3, 4))))
    assert (
        raw == struct.pack("<II", 0x184D2A5E, 25) + struct.pack("<IIII", 10, 20, 3, 4) + b"\x02\0\0\0\0\xb1\xea\x92\x8f"
    )


@given(st.lists(st.tuples(U32, U32), max_size=12), st.data())
def test_every_truncation_of_a_seek_table_is_refused_by_name(frames, data):
    raw = zs.seek_table_bytes(zs.SeekTable(tuple(frames)))
    k = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(CorruptStreamError, match="'tbl'"):
        zs.parse_seek_table(raw[:k], "tbl")


@pytest.mark.parametrize("at", [0, 1, 2, 3, 4, 5, 6, 7, -9, -8, -7, -6, -5, -4, -3, -2, -1])
def test_a_damaged_seek_table_header_or_footer_is_refused_by_name(at):
    raw = bytearray(zs.seek_table_bytes(zs.SeekTable(((10, 20), (3, 4)))))
    for flip in (0x01, 0x04, 0x80, 0xFF):
        damaged = bytearray(raw)
        damaged[at] ^= flip
        if at == -5 and flip == 0x01:  # the descriptor's unused bits: not interpreted (the spec)
            assert zs.parse_seek_table(damaged, "tbl").frames == ((10, 20), (3, 4))
            continue
        with pytest.raises(CorruptStreamError, match="'tbl'"):
            zs.parse_seek_table(damaged, "tbl")


def test_a_table_with_checksums_is_refused():
    raw = bytearray(zs.seek_table_bytes(zs.SeekTable(((10, 20),))))
    raw[-5] = 0x80
    with pytest.raises(CorruptStreamError, match="descriptor"):
        zs.parse_seek_table(raw, "tbl")


def test_sizes_that_do_not_fit_a_table_are_not_written():
    with pytest.raises(ValueError):
        zs.seek_table_bytes(zs.SeekTable(((2**32, 1),)))


# streams of frames


@given(DATA, FRAME_BYTES, st.sampled_from([1, 3]))
@settings(max_examples=60, deadline=None)
def test_frames_round_trip_and_every_zstd_reader_reads_them_whole(data, frame_bytes, level):
    stream = zs.zstd_frames(data, level, frame_bytes)
    table = zs.read_seek_table(stream, "s")
    assert len(table.frames) == max(1, -(-len(data) // frame_bytes))
    assert [d for _, d in table.frames[:-1]] == [frame_bytes] * (len(table.frames) - 1)
    assert table.decompressed == len(data) and table.compressed + table.size == len(stream)
    assert _read(stream, len(data)) == (len(data), data)
    assert zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True).read() == data
    for i, (c, d) in enumerate(table.frames):  # each a standard frame with its content size
        start = sum(c for c, _ in table.frames[:i])
        assert zstandard.frame_content_size(stream[start : start + c]) == d


@given(DATA, FRAME_BYTES)
@settings(max_examples=40, deadline=None)
def test_a_buffer_of_another_size_gets_the_size_the_stream_holds(data, frame_bytes):
    stream = zs.zstd_frames(data, 1, frame_bytes)
    assert _read(stream, len(data) + 5)[0] == len(data)
    if data:
        assert _read(stream, len(data) - 1)[0] == len(data)  # len - 1 + 1: there is more


@given(DATA.filter(len), FRAME_BYTES, st.data())
@settings(max_examples=60, deadline=None)
def test_every_truncation_of_a_stream_never_gives_wrong_data(data, frame_bytes, draw):
    stream = zs.zstd_frames(data, 1, frame_bytes)
    k = draw.draw(st.integers(0, len(stream) - 1))
    _never_wrong(stream[:k], data)


@given(DATA.filter(len), FRAME_BYTES, st.data())
@settings(max_examples=80, deadline=None)
def test_a_damaged_byte_of_the_seek_table_never_gives_wrong_data(data, frame_bytes, draw):
    stream = bytearray(zs.zstd_frames(data, 1, frame_bytes))
    table = zs.read_seek_table(stream, "s")
    at = draw.draw(st.integers(len(stream) - table.size, len(stream) - 1))
    stream[at] ^= draw.draw(st.integers(1, 255))
    _never_wrong(bytes(stream), data)


@given(DATA.filter(lambda d: len(d) > 1), st.integers(1, 2000), st.integers(1, 300), st.data())
@settings(max_examples=60, deadline=None)
def test_table_sizes_that_disagree_with_the_data_are_refused(data, frame_bytes, delta, draw):
    stream = zs.zstd_frames(data, 1, frame_bytes)
    table = zs.read_seek_table(stream, "s")
    frames = [list(f) for f in table.frames]
    i = draw.draw(st.integers(0, len(frames) - 1))
    which = draw.draw(st.sampled_from([0, 1]))
    frames[i][which] = max(0, frames[i][which] + draw.draw(st.sampled_from([-delta, delta])))
    forged = zs.SeekTable(tuple(map(tuple, frames)))
    if forged == table:
        return
    forged_stream = stream[: table.compressed] + zs.seek_table_bytes(forged)
    if which == 0:  # compressed sizes that do not add up to the stream
        with pytest.raises(CorruptStreamError, match="'samples'"):
            zs.read_seek_table(forged_stream, "samples")
    _never_wrong(forged_stream, data)


def test_frames_moved_between_entries_are_refused():
    data = _noisy(5000)
    stream = zs.zstd_frames(data, 1, 1000)
    table = zs.read_seek_table(stream, "s")
    (c0, d0), (c1, d1), *rest = table.frames
    for moved in ((c0 + 1, d0), (c1 - 1, d1)), ((c0 - 1, d0), (c1 + 1, d1)):
        forged = stream[: table.compressed] + zs.seek_table_bytes(zs.SeekTable((*moved, *rest)))
        with pytest.raises(CorruptStreamError, match="'samples'"):
            _read(forged, len(data))


def test_a_damaged_frame_in_the_middle_is_refused_by_name():
    data = _noisy(20000)
    stream = bytearray(zs.zstd_frames(data, 1, 1000))
    start = sum(c for c, _ in zs.read_seek_table(stream, "s").frames[:7])
    stream[start : start + 4] = b"\0\0\0\0"
    with pytest.raises(CorruptStreamError, match="'samples'.*magic"):
        _read(bytes(stream), len(data))


@pytest.mark.skipif(shutil.which("zstd") is None, reason="no zstd program")
def test_the_zstd_program_decompresses_a_stream_of_frames(tmp_path):
    data = _noisy(50000)
    (tmp_path / "s.zst").write_bytes(zs.zstd_frames(data, 1, 4096))
    assert subprocess.run(["zstd", "-dc", str(tmp_path / "s.zst")], capture_output=True, check=True).stdout == data


# older streams and older readers


@given(DATA, st.sampled_from([1, 19]))
@settings(max_examples=40, deadline=None)
def test_a_stream_of_one_frame_from_the_older_writer_still_reads(data, level):
    old = zstandard.ZstdCompressor(level=level).compress(data)
    assert zs.read_seek_table(old, "s") is None
    assert _read(old, len(data)) == (len(data), data)
    assert _read(old, len(data) + 3)[0] == len(data)
    if data:
        assert _read(old, len(data) - 1)[0] == len(data)


def test_a_single_frame_that_happens_to_end_with_the_seekable_magic_still_reads():
    data = np.random.default_rng(5).integers(0, 256, 5000, dtype=np.uint8).tobytes() + b"\xb1\xea\x92\x8f"
    old = zstandard.ZstdCompressor(level=1).compress(data)  # incompressible: a raw block, the data's bytes last
    assert old.endswith(b"\xb1\xea\x92\x8f")
    with pytest.raises(CorruptStreamError):
        zs.read_seek_table(old, "samples")
    assert _read(old, len(data)) == (len(data), data)


def test_a_single_frame_with_bytes_after_it_or_cut_short_is_refused():
    data = _noisy(3000)
    old = zstandard.ZstdCompressor(level=1).compress(data)
    for damaged in (old + b"\0", old[:-1], old[:5], b""):
        with pytest.raises(CorruptStreamError, match="'samples'"):
            _read(damaged, len(data))


@given(DATA, FRAME_BYTES)
@settings(max_examples=40, deadline=None)
def test_the_older_streaming_reader_reads_a_stream_of_frames_whole(data, frame_bytes):
    """kvcodec's reader before seek tables (hevc chunks' streams, the transform codec's driven
    fetch) reads frame after frame, and skips the table: the same bytes, sequentially."""
    stream = zs.zstd_frames(data, 1, frame_bytes)
    buf = np.zeros(len(data), dtype=np.uint8)
    assert _old_unzstd_into(stream, buf, "samples") == len(data) and buf.tobytes() == data
    if data:
        assert _old_unzstd_into(stream, np.zeros(len(data) - 1, dtype=np.uint8), "samples") == len(data)


def test_the_older_one_shot_reader_gets_the_first_frame_only_and_refuses_the_stream():
    """The transform codec's reader before seek tables (a one-shot decompress of one frame) gets
    the first frame's bytes: its size check refuses the stream by name, no wrong data."""
    data = _noisy(3 * 1000 + 7)
    with pytest.raises(CorruptStreamError, match="'samples' holds 1000 bytes, expected 3007"):
        unzstd(zs.zstd_frames(data, 1, 1000), "samples", len(data))
    assert unzstd(zs.zstd_frames(data, 1, len(data)), "samples", len(data)) == data  # one frame and its table


# the codecs' sample streams


def _small_frames(monkeypatch, module) -> None:  # the int8 codec's samples: zstd_frames' default frame size
    monkeypatch.setattr(module, "zstd_frames", functools.partial(zs.zstd_frames, frame_bytes=1000))


def _kv(tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(tokens)
    return (torch.randn(2, 2, tokens, 2, 32, generator=g) * torch.linspace(0.1, 2, 32)).to(torch.float16)


def _samples_stream(blob: bytes):
    h, payload = parse_chunk(blob)
    return h, split_streams(payload, h.streams, "chunk")


def _with_samples(blob: bytes, samples: bytes) -> bytes:
    h, streams = _samples_stream(blob)
    streams = {**streams, "samples": samples}
    entries = tuple(StreamEntry(e.name, e.codec, len(streams[e.name]), crc32(streams[e.name])) for e in h.streams)
    forged = dataclasses.replace(h, streams=entries)
    return write_object(CHUNK_MAGIC, forged.to_json(), [bytes(streams[e.name]) for e in h.streams])


@pytest.mark.parametrize("quant", ["int8", "exact"])
def test_hevc_chunks_with_samples_in_frames_restore_as_their_video_and_older_one_frame_chunks(monkeypatch, quant):
    config = CodecConfig(chunk_tokens=24, resolutions=((144, 144),), plain_fallback=False, quant=quant)
    kv = _kv(48)
    from_video = kvcodec.decode(kvcodec.encode(kv, dataclasses.replace(config, sample_coder="hevc")))
    _small_frames(monkeypatch, hevc_encode)
    zconfig = dataclasses.replace(config, sample_coder="zstd")
    assert torch.equal(kvcodec.decode(kvcodec.encode(kv, zconfig)).view(torch.int16), from_video.view(torch.int16))
    blob = encode_chunks(kv[:, :, :24], zconfig)[0].blobs[0]
    samples = _samples_stream(blob)[1]["samples"]
    assert len(zs.read_seek_table(samples, "s").frames) > 1
    raw = zstandard.ZstdDecompressor().stream_reader(bytes(samples), read_across_frames=True).read()
    old = _with_samples(blob, zstandard.ZstdCompressor(level=1).compress(raw))  # as the older writer made it
    assert torch.equal(decode_chunk_blob(old).view(torch.int16), decode_chunk_blob(blob).view(torch.int16))
    assert torch.equal(decode_chunk_blob(blob).view(torch.int16), from_video[:, :, :24].view(torch.int16))


def test_transform_chunks_with_samples_in_frames_restore_as_one_frame_chunks(monkeypatch, synthetic_kvt):
    from synthetic import synthetic_kv

    kv = synthetic_kv(64, seed=3)
    c = TransformCodec(synthetic_kvt, chunk_tokens=64, resolutions=((64, 64),), coder="zstd", bits_per_value=3.0)
    one_frame = c.encode_chunks(kv)[0].blobs[0]
    monkeypatch.setattr(transform_codec, "SAMPLES_FRAME_BYTES", 1000)
    framed = c.encode_chunks(kv)[0].blobs[0]
    a, b = torch.empty_like(kv), torch.empty_like(kv)
    c.decode_chunk(one_frame, a)
    c.decode_chunk(framed, b)
    assert torch.equal(a, b)
    streams = c._read_entries(framed)[2]
    assert len(zs.read_seek_table(streams["samples"], "s").frames) > 1


# threads


def test_many_threads_reading_framed_streams_at_once_each_get_their_own_bytes():
    datas = [_noisy(7000 + 300 * i, i) for i in range(16)]
    streams = [zs.zstd_frames(d, 1, 700) for d in datas]
    results: dict[int, list] = {}

    def reader(i: int) -> None:
        results[i] = [_read(streams[i], len(datas[i]), f"s{i}") for _ in range(5)]

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert all(results[i] == [(len(d), d)] * 5 for i, d in enumerate(datas))
