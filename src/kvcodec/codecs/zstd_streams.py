"""zstd-coded streams: written as independent frames with a seek table (zstd's seekable format),
decompressed straight into a caller's buffer (a pinned upload buffer, say), frame by frame on the
calling thread (a fetch decompresses several chunks at once on its host threads).

A stream is either ONE zstd frame (every stream of older writers, and the small side streams) or,
as `zstd_frames` writes it, standard zstd frames (content size written) followed by a seek table
in zstd's seekable format (contrib/seekable_format): a skippable frame

    0x184D2A5E (u32 LE) | 8 * n + 9 (u32 LE) | n x (compressed size u32 LE, decompressed size u32 LE)
    | n (u32 LE) | descriptor (u8: 0, no checksums) | 0x8F92EAB1 (u32 LE)

Any zstd decoder decompresses such a stream whole (it skips the skippable frame); a reader that
reads only the first frame gets fewer bytes than the stream holds.
"""

from __future__ import annotations

import dataclasses
import struct
import threading

import numpy as np
import zstandard

from kvcodec.errors import CorruptStreamError

MAX_FRAME_BYTES = 1 << 30  # the seekable format's reference implementation's limit per frame
# A chunk's samples per frame (the int8 codec's; the transform's is its own, also one): one frame (and its
# table). 128 KiB-1 MiB frames cost no bytes (within 0.1% on SmolLM2, benchmarks/results/zstd-frames-cpu.md) and
# halve one chunk's decompression alone when read in parallel, but a driven fetch on the H200 restored int8 KV
# 1.3-1.7x slower with 256 KiB frames read on a pool of Python threads than with one frame per chunk on the host
# threads, same store, one call (benchmarks/results/fetch-h200-frames.md). Python threads read a stream's frames
# in order; the native threads (zstd_native) in parallel.
SAMPLES_FRAME_BYTES = MAX_FRAME_BYTES
SKIPPABLE_MAGIC = 0x184D2A5E
SEEKABLE_MAGIC = 0x8F92EAB1
_HEAD = struct.Struct("<II")  # skippable magic, size of the rest of the frame
_ENTRY = struct.Struct("<II")  # compressed size, decompressed size
_FOOTER = struct.Struct("<IBI")  # frames, descriptor, seekable magic
TABLE_OVERHEAD = _HEAD.size + _FOOTER.size
_RESERVED = 0x7C  # descriptor bits 6-2: must be 0
_CHECKSUMS = 0x80  # descriptor bit 7: entries carry checksums (never written here)
_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE_MASK, _SKIPPABLE_BASE = 0xFFFFFFF0, 0x184D2A50


@dataclasses.dataclass(frozen=True)
class SeekTable:
    """A stream's frames, in order: (compressed bytes, decompressed bytes) of each."""

    frames: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        """Bytes of the table's skippable frame."""
        return TABLE_OVERHEAD + _ENTRY.size * len(self.frames)

    @property
    def compressed(self) -> int:
        return sum(c for c, _ in self.frames)

    @property
    def decompressed(self) -> int:
        return sum(d for _, d in self.frames)


@dataclasses.dataclass(frozen=True)
class _Span:
    """A frame's place in the stream and in the output."""

    start: int
    end: int
    out_start: int
    out_end: int


def seek_table_bytes(table: SeekTable) -> bytes:
    """The seek table's skippable frame (no checksums)."""
    for c, d in table.frames:
        if not (0 <= c < 1 << 32 and 0 <= d < 1 << 32):
            raise ValueError(f"frame sizes ({c}, {d}) do not fit a seek table's u32 fields")
    n = len(table.frames)
    entries = b"".join(_ENTRY.pack(c, d) for c, d in table.frames)
    return _HEAD.pack(SKIPPABLE_MAGIC, table.size - _HEAD.size) + entries + _FOOTER.pack(n, 0, SEEKABLE_MAGIC)


def parse_seek_table(data, name: str) -> SeekTable:
    """The seek table that is exactly `data` (a skippable frame, as seek_table_bytes writes it)."""
    view = memoryview(data).cast("B")
    if len(view) < TABLE_OVERHEAD:
        raise CorruptStreamError(f"stream {name!r}: seek table of {len(view)} bytes, under {TABLE_OVERHEAD}")
    n, descriptor, magic = _FOOTER.unpack_from(view, len(view) - _FOOTER.size)
    if magic != SEEKABLE_MAGIC:
        raise CorruptStreamError(f"stream {name!r}: seek table does not end with the seekable magic")
    if descriptor & (_RESERVED | _CHECKSUMS):
        raise CorruptStreamError(f"stream {name!r}: seek table descriptor {descriptor:#04x} is not 0 (checksums)")
    skippable, rest = _HEAD.unpack_from(view, 0)
    expected = TABLE_OVERHEAD + _ENTRY.size * n
    if skippable != SKIPPABLE_MAGIC or rest != len(view) - _HEAD.size or len(view) != expected:
        raise CorruptStreamError(
            f"stream {name!r}: seek table of {len(view)} bytes (frame size field {rest}, magic {skippable:#x})"
            f" does not hold {n} entries"
        )
    frames = tuple(_ENTRY.unpack_from(view, _HEAD.size + _ENTRY.size * i) for i in range(n))
    return SeekTable(frames)


def read_seek_table(data, name: str) -> SeekTable | None:
    """The seek table at the end of a stream, checked against the stream's length; None when the
    stream does not end with one (a stream of one frame)."""
    view = memoryview(data).cast("B")
    if len(view) < TABLE_OVERHEAD or _FOOTER.unpack_from(view, len(view) - _FOOTER.size)[2] != SEEKABLE_MAGIC:
        return None
    n = _FOOTER.unpack_from(view, len(view) - _FOOTER.size)[0]
    size = TABLE_OVERHEAD + _ENTRY.size * n
    if size > len(view):
        raise CorruptStreamError(f"stream {name!r} of {len(view)} bytes ends with a seek table of {n} frames")
    table = parse_seek_table(view[len(view) - size :], name)
    if table.compressed + table.size != len(view):
        raise CorruptStreamError(
            f"stream {name!r}: seek table's frames hold {table.compressed} bytes, the stream"
            f" {len(view) - table.size} before its table"
        )
    return table


def zstd_frames(data, level: int, frame_bytes: int = SAMPLES_FRAME_BYTES) -> bytes:
    """`data` as zstd frames of `frame_bytes` each (the last shorter), each its own standard
    frame with its content size, then their seek table: decompressible in parallel."""
    if not 1 <= frame_bytes <= MAX_FRAME_BYTES:
        raise ValueError(f"frame_bytes {frame_bytes} is outside 1..{MAX_FRAME_BYTES}")
    view = memoryview(data).cast("B")
    cctx = zstandard.ZstdCompressor(level=level)
    pieces = [view[a : a + frame_bytes] for a in range(0, max(len(view), 1), frame_bytes)]
    frames = [cctx.compress(p) for p in pieces]
    table = SeekTable(tuple((len(f), len(p)) for f, p in zip(frames, pieces, strict=True)))
    return b"".join([*frames, seek_table_bytes(table)])


def frame_size(data, name: str) -> int:
    """Bytes of the zstd (or skippable) frame at the start of `data`: its blocks' headers walked,
    nothing decompressed."""
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise CorruptStreamError(f"stream {name!r} does not decompress: a frame of {len(view)} bytes is truncated")
    magic = int.from_bytes(view[:4], "little")
    if magic & _SKIPPABLE_MASK == _SKIPPABLE_BASE:
        return _within(8 + int.from_bytes(view[4:8], "little"), view, name)
    if magic != _ZSTD_MAGIC:
        raise CorruptStreamError(
            f"stream {name!r} does not decompress: a frame starts with {magic:#010x}, not zstd's magic"
        )
    try:
        p = zstandard.frame_header_size(view)
    except zstandard.ZstdError as e:
        raise CorruptStreamError(f"stream {name!r} does not decompress: {e}") from e
    checksum = 4 if view[4] & 0x04 else 0
    while True:
        _within(p + 3, view, name)
        h = int.from_bytes(view[p : p + 3], "little")
        kind, size = (h >> 1) & 3, h >> 3
        if kind == 3:
            raise CorruptStreamError(f"stream {name!r} does not decompress: a block of the reserved type")
        p += 3 + (1 if kind == 1 else size)
        if h & 1:
            return _within(p + checksum, view, name)


def _within(end: int, view: memoryview, name: str) -> int:
    if end > len(view):
        raise CorruptStreamError(f"stream {name!r} of {len(view)} bytes is truncated: a frame ends at byte {end}")
    return end


_local = threading.local()  # a decompression context per thread: making one per stream costs more than small streams


def _dctx() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def unzstd_into(data, buf: np.ndarray, name: str) -> int:
    """Decompress `data` (one zstd frame, or frames with a seek table) into `buf`, frame by frame;
    the decompressed size (buf.size + 1 when there is more)."""
    view, out = memoryview(data).cast("B"), memoryview(buf).cast("B")
    table = _seek_table_of(view, name)
    if table is None:
        return _one_frame(view, out, name)
    total = table.decompressed
    if total > len(out):
        return len(out) + 1
    for index, span in _checked_frames(view, table, name):
        got = _decompress(view[span.start : span.end], out[span.out_start : span.out_end], name)
        if got != span.out_end - span.out_start:
            raise CorruptStreamError(
                f"stream {name!r}: frame {index} holds {got} bytes, its table entry {span.out_end - span.out_start}"
            )
    return total


def frame_spans(data, size: int, name: str) -> list[tuple[int, _Span]]:
    """unzstd_into's checks that need no decompression, for a stream that must decompress to
    exactly `size` bytes: (index, span) of each frame to decompress, in order (a stream of one
    frame: that frame, to fill all `size` bytes; skippable frames left out). Each frame must then
    fill its span's output exactly. CorruptStreamError where the stream cannot."""
    view = memoryview(data).cast("B")
    table = _seek_table_of(view, name)
    if table is None:
        end = frame_size(view, name)
        if end != len(view):
            raise CorruptStreamError(f"stream {name!r} has {len(view) - end} bytes after its frame")
        return [(0, _Span(0, len(view), 0, size))]
    if table.decompressed != size:
        raise CorruptStreamError(f"stream {name!r} holds {table.decompressed} bytes, expected {size}")
    return _checked_frames(view, table, name)


def _seek_table_of(view: memoryview, name: str) -> SeekTable | None:
    """read_seek_table, but a stream that is exactly one zstd frame is one (never a stream with
    a table: the table follows its frames), however its last bytes read."""
    try:
        return read_seek_table(view, name)
    except CorruptStreamError:
        try:
            if frame_size(view, name) == len(view):
                return None
        except CorruptStreamError:
            pass
        raise


def _one_frame(view: memoryview, out: memoryview, name: str) -> int:
    """A stream of one frame (as older writers made every stream): read as far as `out` holds."""
    end = frame_size(view, name)
    if end != len(view):
        raise CorruptStreamError(f"stream {name!r} has {len(view) - end} bytes after its frame")
    return _decompress(view, out, name)


def _spans(table: SeekTable) -> list[_Span]:
    spans, at, out_at = [], 0, 0
    for c, d in table.frames:
        spans.append(_Span(at, at + c, out_at, out_at + d))
        at, out_at = at + c, out_at + d
    return spans


def _checked_frames(view: memoryview, table: SeekTable, name: str) -> list[tuple[int, _Span]]:
    """(index, span) of the table's frames that decompress, each checked to span its bytes
    exactly; a skippable frame (no output) must have no output in the table."""
    frames = []
    for index, span in enumerate(_spans(table)):
        frame = view[span.start : span.end]
        if frame_size(frame, name) != len(frame):
            raise CorruptStreamError(
                f"stream {name!r}: frame {index} does not span its {len(frame)} bytes in the table"
            )
        if int.from_bytes(frame[:4], "little") & _SKIPPABLE_MASK != _SKIPPABLE_BASE:
            frames.append((index, span))
        elif span.out_end != span.out_start:
            raise CorruptStreamError(
                f"stream {name!r}: frame {index} holds 0 bytes, its table entry {span.out_end - span.out_start}"
            )
    return frames


def _decompress(frame: memoryview, dest: memoryview, name: str) -> int:
    """One zstd frame into `dest`: its size (len(dest) + 1 when it holds more)."""
    got = 0
    try:
        with _dctx().stream_reader(frame) as reader:
            while got < len(dest):
                n = reader.readinto(dest[got:])
                if not n:
                    return got
                got += n
            return got + len(reader.read(1))
    except zstandard.ZstdError as e:
        raise CorruptStreamError(f"stream {name!r} does not decompress: {e}") from e
