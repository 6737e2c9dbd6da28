"""kvcodec's binary containers, version 2 (documented in docs/FORMAT.md).

Two kinds of object, both laid out as

    magic (4 bytes) | version (u16 LE) | header length (u32 LE) | header (UTF-8 JSON)
    | header CRC32 (u32 LE) | payload

* A **chunk blob** (magic `KVCC`) is one chunk of tokens at one frame resolution, decodable on its
  own: its header names the model shape, dtype, quantization, layout and the streams that follow
  (each with length and CRC32). This is the unit a store holds and a fetcher moves.
* A **file** (magic `KVCF`, extension .kvc) is a whole prefix: a header with the model shape,
  codec config and an index of chunk blobs (offset, length, CRC32, per chunk and resolution),
  then the blobs themselves.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from typing import Any

from kvcodec.errors import ChecksumError, FormatError, TruncatedError

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 chunk headers have no video_bits (every bit in the video)
CHUNK_MAGIC = b"KVCC"
FILE_MAGIC = b"KVCF"
_PREFIX = struct.Struct("<4sHI")
_CRC = struct.Struct("<I")
MAX_HEADER_BYTES = 16 << 20


def crc32(data: bytes | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class StreamEntry:
    name: str  # "side", "video", "bytes1", ...
    codec: str  # "hevc", "zstd", "raw"
    length: int
    crc32: int


@dataclasses.dataclass(frozen=True)
class ChunkHeader:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # "float16" | "bfloat16" | "float32"
    chunk_index: int
    start_token: int
    tokens: int
    quant: str
    layer_bits: tuple[int, ...]
    param_dtype: str  # dtype of the quantization side information ("float16"/"float32"/"")
    resolution: tuple[int, int]
    layout: dict[str, Any]
    frames: int
    streams: tuple[StreamEntry, ...]
    video_bits: int = 8  # top bits of each sample in the video stream; the rest in the "low" stream
    key: str | None = None  # the chained prefix key the chunk was stored under (binds it to its prefix)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.tokens, self.kv_heads, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        return sum(s.length for s in self.streams)

    def stream_sizes(self) -> dict[str, int]:
        return {s.name: s.length for s in self.streams}

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["key"] is None:
            del d["key"]
        d["format"] = "kvcodec-chunk"
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ChunkHeader:
        return _header_from_json(cls, d, "chunk", lambda kw: {
            **kw,
            "layer_bits": tuple(kw["layer_bits"]),
            "resolution": tuple(kw["resolution"]),
            "streams": tuple(StreamEntry(**s) for s in kw["streams"]),
        })


@dataclasses.dataclass(frozen=True)
class BlobEntry:
    chunk_index: int
    resolution: tuple[int, int]
    offset: int  # from the start of the payload
    length: int
    crc32: int


@dataclasses.dataclass(frozen=True)
class FileHeader:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    tokens: int
    config: dict[str, Any]
    chunk_tokens: tuple[int, ...]  # tokens of each chunk
    blobs: tuple[BlobEntry, ...]

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.tokens, self.kv_heads, self.head_dim)

    @property
    def resolutions(self) -> tuple[tuple[int, int], ...]:
        return tuple(tuple(r) for r in self.config["resolutions"])

    def blob(self, chunk_index: int, resolution: tuple[int, int]) -> BlobEntry:
        for b in self.blobs:
            if b.chunk_index == chunk_index and b.resolution == tuple(resolution):
                return b
        raise FormatError(f"file has no blob for chunk {chunk_index} at {resolution[0]}x{resolution[1]}")

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["format"] = "kvcodec-file"
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FileHeader:
        return _header_from_json(cls, d, "file", lambda kw: {
            **kw,
            "chunk_tokens": tuple(kw["chunk_tokens"]),
            "blobs": tuple(BlobEntry(**{**b, "resolution": tuple(b["resolution"])}) for b in kw["blobs"]),
        })


def _header_from_json(cls, d: dict[str, Any], kind: str, convert):
    """A header dataclass from its JSON object: the format tag checked, every field without a
    default required, JSON lists turned back into tuples by `convert`; any mismatch is a FormatError."""
    if d.get("format") != f"kvcodec-{kind}":
        raise FormatError(f"header is not a kvcodec {kind} header")
    try:
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d or f.default is dataclasses.MISSING}
        return cls(**convert(kw))
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"malformed {kind} header: {e!r}") from e


def object_version(data: bytes | memoryview) -> int:
    """The format version written in an object's fixed prefix (call after read_object checked it)."""
    return _PREFIX.unpack_from(memoryview(data), 0)[1]


def write_object(magic: bytes, header: dict[str, Any], payloads: list[bytes]) -> bytes:
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    parts = [_PREFIX.pack(magic, FORMAT_VERSION, len(head)), head, _CRC.pack(crc32(head)), *payloads]
    return b"".join(parts)


def read_object(data: bytes | memoryview, magic: bytes, what: str) -> tuple[dict[str, Any], memoryview]:
    """Parse and verify the prefix and header; returns (header dict, payload view)."""
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        if bytes(view[:4]) == magic[: len(view[:4])]:
            raise TruncatedError(f"{what} truncated: {len(view)} bytes, shorter than its fixed prefix")
        raise FormatError(f"not a {what} ({len(view)} bytes)")
    got_magic, version, head_len = _PREFIX.unpack_from(view, 0)
    if got_magic != magic:
        other = {CHUNK_MAGIC: "chunk blob", FILE_MAGIC: "kvcodec file (.kvc)"}.get(got_magic)
        hint = f"; it is a {other}" if other else ""
        raise FormatError(f"not a {what}: magic {got_magic!r}, expected {magic!r}{hint}")
    if version not in READABLE_VERSIONS:
        raise FormatError(
            f"{what} has format version {version}; this kvcodec reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    if head_len > MAX_HEADER_BYTES:
        raise FormatError(f"{what} announces a {head_len}-byte header, over the {MAX_HEADER_BYTES} limit")
    end = _PREFIX.size + head_len
    if len(view) < end + _CRC.size:
        raise TruncatedError(f"{what} truncated inside its header ({len(view)} of at least {end + _CRC.size} bytes)")
    head = view[_PREFIX.size : end]
    (want,) = _CRC.unpack_from(view, end)
    if crc32(head) != want:
        raise ChecksumError(f"{what} header checksum mismatch (corrupted header)")
    try:
        header = json.loads(bytes(head))
    except ValueError as e:
        raise FormatError(f"{what} header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise FormatError(f"{what} header is not a JSON object")
    return header, view[end + _CRC.size :]


def split_streams(payload: memoryview, streams: tuple[StreamEntry, ...], what: str) -> dict[str, memoryview]:
    """Cut the payload into the announced streams and verify each one's checksum."""
    need = sum(s.length for s in streams)
    if len(payload) < need:
        raise TruncatedError(f"{what} truncated: payload has {len(payload)} of {need} bytes")
    if len(payload) > need:
        raise FormatError(f"{what} has {len(payload) - need} unexpected bytes after its streams")
    out, pos = {}, 0
    for s in streams:
        piece = payload[pos : pos + s.length]
        if crc32(piece) != s.crc32:
            raise ChecksumError(f"{what}: stream {s.name!r} fails its checksum (corrupted in storage or transit)")
        out[s.name] = piece
        pos += s.length
    return out
