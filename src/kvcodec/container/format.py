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
import functools
import json
import math
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvcodec.config import QUANT_MODES, CodecConfig
from kvcodec.container import validate as v
from kvcodec.errors import ChecksumError, FormatError, KVCodecError, TruncatedError

try:  # ISA-L's CRC32 (same polynomial) runs about 10x zlib's on a chunk's streams
    from isal.isal_zlib import crc32 as _crc32
except ImportError:
    _crc32 = zlib.crc32

T = TypeVar("T")
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 chunk headers have no video_bits (every bit in the video)
CHUNK_MAGIC = b"KVCC"
FILE_MAGIC = b"KVCF"
_PREFIX = struct.Struct("<4sHI")
_CRC = struct.Struct("<I")
MAX_HEADER_BYTES = 16 << 20
MAX_KEPT_HEADER_BYTES = 64 << 10  # read_parsed keeps what it parsed of headers up to this size (a real one: < 8 KB)
PLAIN = "plain"


def crc32(data: bytes | memoryview) -> int:
    return _crc32(data) & 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class StreamEntry:
    name: str  # "side", "video", "bytes1", ...
    codec: str  # "hevc", "zstd", "raw"
    length: int
    crc32: int


_STREAM = v.record(
    {
        "name": v.text(64),
        "codec": v.choice(v.STREAM_CODECS),
        "length": v.integer(0, 1 << 40),
        "crc32": v.integer(0, 0xFFFFFFFF),
    },
    StreamEntry,
)
CHUNK_QUANTS = (*QUANT_MODES, PLAIN)


@dataclasses.dataclass(frozen=True)
class ChunkHeader:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # "float16" | "bfloat16" | "float32"
    chunk_index: int
    start_token: int
    tokens: int
    quant: str  # a CodecConfig quant, or "plain" (the values' own bytes: small chunks)
    layer_bits: tuple[int, ...]
    param_dtype: str  # dtype of the quantization side information ("float16"/"float32"/"")
    resolution: tuple[int, int]
    layout: dict[str, Any]  # a LayoutPlan as a dict ({} for plain chunks)
    frames: int
    streams: tuple[StreamEntry, ...]
    video_bits: int = 8  # top bits of each sample in the video stream; the rest in the "low" stream
    key: str | None = None  # the store key the chunk was written under, when bound to one
    layer_offset: int = 0  # a split chunk's part: the chunk's layer its first layer is (split version 3)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.tokens, self.kv_heads, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        return sum(s.length for s in self.streams)

    @property
    def decoded_bytes(self) -> int:
        return math.prod(self.shape) * v.DTYPE_BYTES[self.dtype]

    def stream_sizes(self) -> dict[str, int]:
        return {s.name: s.length for s in self.streams}

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["key"] is None:
            del d["key"]  # unbound chunks keep the version-2 header unchanged
        if not d["layer_offset"]:
            del d["layer_offset"]  # only the parts of a split chunk after its first carry one
        d["format"] = "kvcodec-chunk"
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ChunkHeader:
        h = cls(**_checked(d, "chunk", _CHUNK_FIELDS, {"video_bits": 8, "key": None, "layer_offset": 0}))
        check_chunk_header(h)
        return h


_SHAPE_FIELDS = {
    "layers": v.integer(1, v.MAX_DIM),
    "kv_heads": v.integer(1, v.MAX_DIM),
    "head_dim": v.integer(1, v.MAX_DIM),
    "dtype": v.choice(tuple(v.DTYPE_BYTES)),
}
_CHUNK_FIELDS = {
    **_SHAPE_FIELDS,
    "chunk_index": v.integer(0, v.MAX_TOKENS),
    "start_token": v.integer(0, v.MAX_TOKENS),
    "tokens": v.integer(1, v.MAX_TOKENS),
    "quant": v.choice(CHUNK_QUANTS),
    "layer_bits": v.listing(v.integer(2, 8), 0, v.MAX_DIM),
    "param_dtype": v.choice(v.PARAM_DTYPES),
    "resolution": v.pair(v.integer(1, v.MAX_FRAME_SIDE)),
    "layout": v.mapping("an object (the tile layout)"),
    "frames": v.integer(0, v.MAX_TOKENS),
    "streams": v.listing(_STREAM, 1, 64),
    "video_bits": v.integer(1, 8),
    "key": v.text(512, optional=True),
    "layer_offset": v.integer(0, v.MAX_DIM),
}


def check_chunk_header(h: ChunkHeader) -> None:
    """Fields that must agree with each other (each one's type and range is already checked)."""
    names = [s.name for s in h.streams]
    if len(set(names)) != len(names):
        raise FormatError(f"header field 'streams' repeats a name: {names}")
    integer_mode = h.quant.startswith("int")
    if integer_mode != (len(h.layer_bits) == h.layers):
        raise v.fail("layer_bits", list(h.layer_bits), f"{h.layers} entries for {h.quant}" if integer_mode else "[]")
    if integer_mode != (h.param_dtype != ""):
        raise v.fail("param_dtype", h.param_dtype, "float16/float32 for integer modes, '' otherwise")
    if h.quant == PLAIN:
        if h.layout or h.frames or names != ["plain"]:
            raise FormatError("a plain chunk has no layout, no frames and one stream named 'plain'")
    else:
        _check_layout(h)
    v.check_expansion(h.decoded_bytes, h.payload_bytes, f"chunk {h.chunk_index}")


def _check_layout(h: ChunkHeader) -> None:
    lay = v.LAYOUT(h.layout, "layout")
    units = h.layers * 2 * h.kv_heads
    if (lay["width"], lay["height"]) != h.resolution or lay["units"] != units or lay["dim"] != h.head_dim:
        raise FormatError(
            f"header field 'layout' ({lay['width']}x{lay['height']}, {lay['units']} units of {lay['dim']}) "
            f"does not match the chunk ({h.resolution[0]}x{h.resolution[1]}, {units} units of {h.head_dim})"
        )
    tpf, tw, th = lay["tokens_per_frame"], lay["tile_w"], lay["tile_h"]
    if tw > lay["width"] or th > lay["height"] or tw * th != tpf * h.head_dim:
        raise FormatError(f"header field 'layout': a {tw}x{th} tile cannot hold {tpf} tokens of {h.head_dim}")
    if 3 * (lay["width"] // tw) * (lay["height"] // th) < units:
        raise FormatError(f"header field 'layout': the frame holds fewer than {units} tiles")
    if h.frames != -(-h.tokens // tpf):
        raise v.fail("frames", h.frames, f"{-(-h.tokens // tpf)} ({h.tokens} tokens, {tpf} per frame)")


@dataclasses.dataclass(frozen=True)
class BlobEntry:
    chunk_index: int
    resolution: tuple[int, int]
    offset: int  # from the start of the payload
    length: int
    crc32: int


BLOB_FIELDS = {  # a file's index entry of one chunk blob (also the grouped file's)
    "chunk_index": v.integer(0, v.MAX_TOKENS),
    "resolution": v.pair(v.integer(1, v.MAX_FRAME_SIDE)),
    "offset": v.integer(0, 1 << 48),
    "length": v.integer(1, 1 << 40),
    "crc32": v.integer(0, 0xFFFFFFFF),
}
_BLOB = v.record(BLOB_FIELDS, BlobEntry)


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
    file_id: str | None = None  # content id; chunk i of n carries the key file_chunk_key(file_id, i, n)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.tokens, self.kv_heads, self.head_dim)

    @property
    def decoded_bytes(self) -> int:
        return math.prod(self.shape) * v.DTYPE_BYTES[self.dtype]

    @property
    def resolutions(self) -> tuple[tuple[int, int], ...]:
        return tuple(tuple(r) for r in self.config["resolutions"])

    @property
    def payload_bytes(self) -> int:
        return max((b.offset + b.length for b in self.blobs), default=0)

    def start_token(self, chunk_index: int) -> int:
        return sum(self.chunk_tokens[:chunk_index])

    def blob(self, chunk_index: int, resolution: tuple[int, int]) -> BlobEntry:
        for b in self.blobs:
            if b.chunk_index == chunk_index and b.resolution == tuple(resolution):
                return b
        raise FormatError(f"file has no blob for chunk {chunk_index} at {resolution[0]}x{resolution[1]}")

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["file_id"] is None:
            del d["file_id"]
        d["format"] = "kvcodec-file"
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FileHeader:
        fh = cls(**_checked(d, "file", _FILE_FIELDS, {"file_id": None}))
        return check_file_header(fh)


_FILE_FIELDS = {
    **_SHAPE_FIELDS,
    "tokens": v.integer(1, v.MAX_TOKENS),
    "config": v.mapping("an object (the CodecConfig)"),
    "chunk_tokens": v.listing(v.integer(1, v.MAX_TOKENS), 1),
    "blobs": v.listing(_BLOB, 1),
    "file_id": v.text(64),
}


def file_chunk_key(file_id: str | None, index: int, count: int) -> str | None:
    """The key chunk `index` of a file of `count` chunks carries: bound to the file's content id and to its
    chunk count, so that a file header edited to list fewer chunks is refused (None: unbound)."""
    return None if file_id is None else f"{file_id}/{index}/{count}"


def file_chunk_key_fits(key: str | None, file_id: str | None, index: int, count: int) -> bool:
    """Whether a chunk's `key` is the one chunk `index` of a file of `count` chunks carries; files
    written before the count was bound (session 76) carry `<file_id>/<index>`, still read."""
    return key == file_chunk_key(file_id, index, count) or (file_id is not None and key == f"{file_id}/{index}")


def check_file_header(fh: FileHeader) -> FileHeader:
    """`fh` with its config completed by CodecConfig's defaults, once the config parses, the
    chunks cover exactly `tokens`, and every chunk has exactly one blob at every resolution."""
    try:
        config = CodecConfig.from_dict(fh.config)
    except (KVCodecError, TypeError, ValueError) as e:
        raise FormatError(f"header field 'config' is not a valid CodecConfig: {e}") from e
    if sum(fh.chunk_tokens) != fh.tokens:
        raise v.fail("chunk_tokens", list(fh.chunk_tokens), f"chunk sizes adding up to tokens={fh.tokens}")
    if max(fh.chunk_tokens) > config.chunk_tokens:
        raise v.fail("chunk_tokens", list(fh.chunk_tokens), f"chunks of at most {config.chunk_tokens} tokens")
    want = {(c, r) for c in range(len(fh.chunk_tokens)) for r in config.resolutions}
    have = [(b.chunk_index, b.resolution) for b in fh.blobs]
    if len(set(have)) != len(have) or set(have) != want:
        raise FormatError(
            f"header field 'blobs' does not list exactly one blob per chunk ({len(fh.chunk_tokens)}) "
            f"and resolution ({len(config.resolutions)})"
        )
    return dataclasses.replace(fh, config=config.to_dict())


def check_chunk_against_file(
    fh: FileHeader, index: int, ch: ChunkHeader, resolution: tuple[int, int] | None = None
) -> None:
    """Refuse chunk blob `ch` found at position `index` of file `fh` unless its own header says
    it is that chunk: same model shape and dtype, same index, start token and length, the file's
    quantization (or plain), and the resolution it is listed under."""
    expect = {
        "layers": fh.layers,
        "kv_heads": fh.kv_heads,
        "head_dim": fh.head_dim,
        "dtype": fh.dtype,
        "chunk_index": index,
        "start_token": fh.start_token(index),
        "tokens": fh.chunk_tokens[index],
    }
    if resolution is not None:
        expect["resolution"] = tuple(resolution)
    for name, want in expect.items():
        if getattr(ch, name) != want:
            raise FormatError(
                f"chunk at position {index} of the file says {name}={getattr(ch, name)!r}; the file expects {want!r}"
            )
    count = len(fh.chunk_tokens)
    if not file_chunk_key_fits(ch.key, fh.file_id, index, count):
        raise FormatError(
            f"chunk at position {index} of the file says key={ch.key!r}; the file expects "
            f"{file_chunk_key(fh.file_id, index, count)!r} (a chunk of another file, or a file that lost chunks)"
        )
    if ch.quant not in (fh.config["quant"], PLAIN):
        raise FormatError(f"chunk {index} is coded {ch.quant!r}; the file says {fh.config['quant']!r}")
    check_chunk_config(ch, _file_config(json.dumps(fh.config, sort_keys=True)), f"chunk {index}")


def check_chunk_config(h: ChunkHeader | Any, config: CodecConfig, what: str = "chunk") -> None:
    """Refuse a chunk (or a split chunk's header) coded with other integer bit widths than `config`
    gives its layers: a header whose layer_bits were edited with its checksums recomputed."""
    if getattr(h, "layer_offset", 0):
        raise FormatError(f"{what} is a part of a split chunk (layer_offset {h.layer_offset}), not a whole chunk")
    got = tuple(getattr(h, "layer_bits", ()))
    if not h.quant.startswith("int") or not (got or isinstance(h, ChunkHeader)):
        return  # exact / plain, or a version 1-2 split header (its parts carry the bits)
    if config.layer_bits and len(config.layer_bits) != h.layers:
        raise FormatError(f"{what} has {h.layers} layers; its codec config gives bits for {len(config.layer_bits)}")
    want = tuple(config.bits_for_layer(i) for i in range(h.layers))
    if got != want:
        raise FormatError(f"{what} codes layer bits {list(got)[:8]}; its codec config says {list(want)[:8]}")


@functools.lru_cache(maxsize=64)
def _file_config(config_json: str) -> CodecConfig:
    return CodecConfig.from_dict(json.loads(config_json))


def content_id(tensors, *labels: str) -> str:
    """A 32-hex-digit digest of tensors' bytes and labels: the identity a file gives its chunks
    (their keys), so a chunk of another file, even of the same codec and shape, is refused."""
    import hashlib

    import torch

    h = hashlib.blake2b(digest_size=16)
    for label in labels:
        h.update(label.encode() + b"\0")
    for t in tensors:
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _checked(d: dict[str, Any], kind: str, checks, optional) -> dict[str, Any]:
    """A header's fields, type- and range-checked, after its format tag; FormatError naming
    the field on any mismatch."""
    if d.get("format") != f"kvcodec-{kind}":
        raise FormatError(f"header is not a kvcodec {kind} header")
    extra = sorted(set(d) - set(checks) - {"format"})
    if extra:
        raise FormatError(f"{kind} header has unknown fields {extra}")
    return v.fields_of(d, checks, optional)


def parse_file(data: bytes | memoryview) -> tuple[FileHeader, memoryview]:
    """A file's verified header and payload: the blobs lie inside the payload, which has no
    trailing bytes, and the announced output is not implausibly large for the file."""
    header, payload = read_object(data, FILE_MAGIC, "kvcodec file")
    fh = FileHeader.from_json(header)
    need = fh.payload_bytes
    if len(payload) < need:
        raise TruncatedError(f"kvcodec file truncated: payload has {len(payload)} of {need} bytes")
    if len(payload) > need:
        raise FormatError(f"kvcodec file has {len(payload) - need} unexpected bytes after its last blob")
    v.check_expansion(fh.decoded_bytes, len(memoryview(data)), "kvcodec file")
    return fh, payload


def parse_chunk(blob: bytes | memoryview) -> tuple[ChunkHeader, memoryview]:
    """A chunk blob's verified header and its (not yet verified) payload. The prefix and header
    checksum are checked on every call; the JSON parse and field checks, a pure function of the
    header bytes, are remembered for recent headers (a chunk is inspected, then decoded)."""
    return read_parsed(blob, CHUNK_MAGIC, "kvcodec chunk blob", ChunkHeader.from_json)


def read_parsed(
    data: bytes | memoryview, magic: bytes, what: str, parse: Callable[[dict[str, Any]], T]
) -> tuple[T, memoryview]:
    """read_object, then `parse(header)` (a pure function of the header: its field checks): the
    prefix and the header's checksum are verified on every call, the JSON parse and `parse` are
    remembered for recent headers (a chunk is inspected, then decoded). A header that fails is
    never remembered; a parsed header is shared by the calls that read it (do not change it)."""
    head, payload = _read_head(data, magic, what)
    if len(head) > MAX_KEPT_HEADER_BYTES:  # a damaged or hostile store's padded headers would fill memory
        return parse(_json_object(bytes(head), what)), payload
    return _parsed(parse, bytes(head), what), payload


@functools.lru_cache(maxsize=1024)
def _parsed(parse: Callable[[dict[str, Any]], T], head: bytes, what: str) -> T:
    return parse(_json_object(head, what))


def object_version(data: bytes | memoryview) -> int:
    """The format version written in an object's fixed prefix (call after read_object checked it)."""
    return _PREFIX.unpack_from(memoryview(data), 0)[1]


def write_object(magic: bytes, header: dict[str, Any], payloads: list[bytes]) -> bytes:
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    parts = [_PREFIX.pack(magic, FORMAT_VERSION, len(head)), head, _CRC.pack(crc32(head)), *payloads]
    return b"".join(parts)


def read_object(data: bytes | memoryview, magic: bytes, what: str) -> tuple[dict[str, Any], memoryview]:
    """Parse and verify the prefix and header; returns (header dict, payload view)."""
    head, payload = _read_head(data, magic, what)
    return _json_object(bytes(head), what), payload


def _read_head(data: bytes | memoryview, magic: bytes, what: str) -> tuple[memoryview, memoryview]:
    """Verify the prefix and the header's checksum; returns (header bytes, payload), both views."""
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        if bytes(view[:4]) == magic[: len(view[:4])]:
            raise TruncatedError(f"{what} truncated: {len(view)} bytes, shorter than its fixed prefix")
        raise FormatError(f"not a {what} ({len(view)} bytes)")
    got_magic, version, head_len = _PREFIX.unpack_from(view, 0)
    if got_magic != magic:
        other = {CHUNK_MAGIC: "chunk blob", FILE_MAGIC: "kvcodec file (.kvc)", b"KVCS": "split chunk blob"}.get(
            got_magic
        )
        hint = f"; it is a {other}" if other else ""
        raise FormatError(f"not a {what}: magic {got_magic!r}, expected {magic!r}{hint}")
    if version not in READABLE_VERSIONS:
        raise FormatError(
            f"{what} has format version {version}; this kvcodec reads versions {', '.join(map(str, READABLE_VERSIONS))}"
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
    return head, view[end + _CRC.size :]


def _json_object(head: bytes, what: str) -> dict[str, Any]:
    v.check_json_depth(head, what)
    try:
        header = json.loads(head)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{what} header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise FormatError(f"{what} header is not a JSON object")
    return header


def split_streams(
    payload: memoryview, streams: tuple[StreamEntry, ...], what: str, deferred: frozenset[str] = frozenset()
) -> dict[str, memoryview]:
    """Cut the payload into the announced streams and verify each one's checksum, but those named
    in `deferred` (the caller verifies them with verify_stream before reading them, e.g. on
    another thread)."""
    need = sum(s.length for s in streams)
    if len(payload) < need:
        raise TruncatedError(f"{what} truncated: payload has {len(payload)} of {need} bytes")
    if len(payload) > need:
        raise FormatError(f"{what} has {len(payload) - need} unexpected bytes after its streams")
    out, pos = {}, 0
    for s in streams:
        piece = payload[pos : pos + s.length]
        if s.name not in deferred:
            verify_stream(piece, s, what)
        out[s.name] = piece
        pos += s.length
    return out


def verify_stream(piece: bytes | memoryview, entry: StreamEntry, what: str) -> None:
    """ChecksumError unless `piece` holds the stream `entry` announces."""
    if crc32(piece) != entry.crc32:
        raise checksum_error(entry, what)


def checksum_error(entry: StreamEntry, what: str) -> ChecksumError:
    """The error of a stream whose bytes fail `entry`'s checksum."""
    return ChecksumError(f"{what}: stream {entry.name!r} fails its checksum (corrupted in storage or transit)")


def verify_streams(streams: dict, entries: Sequence[StreamEntry], what: str) -> None:
    """verify_stream of each of `entries` (those split_streams left for later) in `streams`."""
    for entry in entries:
        verify_stream(streams[entry.name], entry, what)
