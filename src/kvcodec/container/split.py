"""Split chunk blobs (docs/FORMAT.md): one chunk as several independent chunk blobs, one per
contiguous range of layers, so that a chunk decodes on several NVDEC engines at once.

    container framing (format.py), magic "KVCS"; JSON header:
    {"format": "kvcodec-split-chunk", "split_version": 3, "layers", "kv_heads", "head_dim",
     "dtype", "chunk_index", "start_token", "tokens", "quant", "resolution", ["key"],
     "parts": [{"layers", "length", "header_crc32"}, ...]}     payload: the parts' chunk blobs (magic "KVCC"), in
                                              layer order, part p covering the layers after part p-1

Each part is a complete chunk blob of its layers with its own header, checksums and video stream;
its header must repeat the split header's chunk index, first token, tokens, heads, head_dim, dtype,
quantization, resolution and key. The parts' own checksums cover every payload byte; their
header CRCs, listed in the split header (version 2), fix which part the split header lists, and
each part's own header says which layer of the chunk its first layer is (`layer_offset`, version
3), so parts of equal layer counts cannot be reordered or exchanged unnoticed, even together with
their split-header entries (version 1 and 2 blobs still read; their parts carry no offset).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from kvcodec.container import validate as v
from kvcodec.container.format import CHUNK_MAGIC, CHUNK_QUANTS, ChunkHeader, parse_chunk, read_object, write_object
from kvcodec.errors import FormatError, TruncatedError

SPLIT_MAGIC = b"KVCS"
SPLIT_VERSION = 3
READABLE_SPLIT_VERSIONS = (1, 2, 3)  # 1: parts without header_crc32; 2: parts without layer_offset
FORMAT_NAME = "kvcodec-split-chunk"
MAX_PARTS = 64


def layer_ranges(layers: int, parts: int) -> tuple[tuple[int, int], ...]:
    """`parts` contiguous, near-equal [start, end) ranges covering `layers` layers (fewer when
    there are fewer layers than parts; the larger ranges come last)."""
    n = max(1, min(parts, layers))
    bounds = [layers * i // n for i in range(n + 1)]
    return tuple(zip(bounds[:-1], bounds[1:]))


@dataclasses.dataclass(frozen=True)
class SplitPart:
    layers: int
    length: int
    header_crc32: int | None = None  # the part blob's own header CRC (version 2)


@dataclasses.dataclass(frozen=True)
class SplitHeader:
    """What a split chunk blob's header says: the whole chunk's identity, and its parts."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    chunk_index: int
    start_token: int
    tokens: int
    quant: str
    resolution: tuple[int, int]
    parts: tuple[SplitPart, ...]
    key: str | None = None
    layer_bits: tuple[int, ...] = ()  # integer modes, version 3: every layer's bit width (the parts' must agree)
    version: int = SPLIT_VERSION  # the split_version it was read with

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.tokens, self.kv_heads, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        return sum(p.length for p in self.parts)

    @property
    def decoded_bytes(self) -> int:
        return math.prod(self.shape) * v.DTYPE_BYTES[self.dtype]

    def layer_ranges(self) -> tuple[tuple[int, int], ...]:
        out, start = [], 0
        for p in self.parts:
            out.append((start, start + p.layers))
            start += p.layers
        return tuple(out)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["parts"] = [{k: x for k, x in dataclasses.asdict(p).items() if x is not None} for p in self.parts]
        if d["key"] is None:
            del d["key"]
        if not d["layer_bits"]:
            del d["layer_bits"]
        del d["version"]
        d["format"] = FORMAT_NAME
        d["split_version"] = SPLIT_VERSION
        return d


_PART_FIELDS = {"layers": v.integer(1, v.MAX_DIM), "length": v.integer(1, 1 << 40)}
_PART = {
    1: v.record(_PART_FIELDS, SplitPart),
    2: v.record({**_PART_FIELDS, "header_crc32": v.integer(0, 0xFFFFFFFF)}, SplitPart),
}
_PART[3] = _PART[2]
_FIELDS = {
    "layers": v.integer(1, v.MAX_DIM),
    "kv_heads": v.integer(1, v.MAX_DIM),
    "head_dim": v.integer(1, v.MAX_DIM),
    "dtype": v.choice(tuple(v.DTYPE_BYTES)),
    "chunk_index": v.integer(0, v.MAX_TOKENS),
    "start_token": v.integer(0, v.MAX_TOKENS),
    "tokens": v.integer(1, v.MAX_TOKENS),
    "quant": v.choice(CHUNK_QUANTS),
    "resolution": v.pair(v.integer(1, v.MAX_FRAME_SIDE)),
    "parts": None,  # per version: _PART
    "key": v.text(512, optional=True),
    "layer_bits": v.listing(v.integer(2, 8), 0, v.MAX_DIM),
}
# the fields a part's own header must repeat
_SHARED = ("kv_heads", "head_dim", "dtype", "chunk_index", "start_token", "tokens", "quant", "resolution", "key")


def is_split(blob: bytes | memoryview) -> bool:
    return bytes(memoryview(blob)[:4]) == SPLIT_MAGIC


def header_crc(blob: bytes | memoryview) -> int:
    """The header CRC a chunk blob carries (after its prefix and header; the blob is verified
    by parse_chunk before this is trusted)."""
    view = memoryview(blob)
    end = 10 + int.from_bytes(view[6:10], "little")
    return int.from_bytes(view[end : end + 4], "little")


def _with_offset(part: bytes, h: ChunkHeader, offset: int) -> tuple[bytes, ChunkHeader]:
    """Part blob `part` whose header also says which layer of the chunk its first layer is."""
    if h.layer_offset == offset:
        return part, h
    _, payload = parse_chunk(part)
    h = dataclasses.replace(h, layer_offset=offset)
    return write_object(CHUNK_MAGIC, h.to_json(), [bytes(payload)]), h


def write_split(parts: list[bytes], headers: list[ChunkHeader]) -> bytes:
    """The split chunk blob of `parts` (chunk blobs of consecutive layer ranges, first layer first);
    each part's header is bound to its place (layer_offset, version 3)."""
    offsets = [sum(h.layers for h in headers[:i]) for i in range(len(headers))]
    bound = [_with_offset(p, h, o) for p, h, o in zip(parts, headers, offsets)]
    parts, headers = [b for b, _ in bound], [h for _, h in bound]
    first = headers[0]
    h = SplitHeader(
        layers=sum(p.layers for p in headers),
        kv_heads=first.kv_heads,
        head_dim=first.head_dim,
        dtype=first.dtype,
        chunk_index=first.chunk_index,
        start_token=first.start_token,
        tokens=first.tokens,
        quant=first.quant,
        resolution=tuple(first.resolution),
        parts=tuple(SplitPart(ph.layers, len(b), header_crc(b)) for ph, b in zip(headers, parts)),
        key=first.key,
        layer_bits=tuple(b for ph in headers for b in ph.layer_bits),
    )
    return write_object(SPLIT_MAGIC, h.to_json(), parts)


def parse_split_header(blob: bytes | memoryview) -> tuple[SplitHeader, memoryview]:
    """A split blob's verified header and its payload (the parts, not yet verified)."""
    d, payload = read_object(blob, SPLIT_MAGIC, "split kvcodec chunk blob")
    version = v.tagged_version(d, FORMAT_NAME, "split_version", READABLE_SPLIT_VERSIONS, _FIELDS, "split chunk")
    checks = {**_FIELDS, "parts": v.listing(_PART[version], 2, MAX_PARTS)}
    fields = v.fields_of({k: d[k] for k in d if k in _FIELDS}, checks, {"key": None, "layer_bits": ()})
    h = SplitHeader(**fields, version=version)
    if h.layer_bits and len(h.layer_bits) != h.layers:
        raise v.fail("layer_bits", list(h.layer_bits), f"{h.layers} entries (one per layer) or none")
    if sum(p.layers for p in h.parts) != h.layers:
        raise v.fail("parts", [p.layers for p in h.parts], f"layer counts adding up to layers={h.layers}")
    need = h.payload_bytes
    if len(payload) != need:
        raise (TruncatedError if len(payload) < need else FormatError)(
            f"split chunk payload has {len(payload)} bytes; its parts take {need}"
        )
    v.check_expansion(h.decoded_bytes, len(payload), f"split chunk {h.chunk_index}")
    return h, payload


def parse_split(blob: bytes | memoryview) -> tuple[SplitHeader, list[tuple[ChunkHeader, memoryview]]]:
    """A split blob's header and, per part, its verified header and whole blob. Every part's
    header must be the chunk's own (same identity fields) over its layer count."""
    h, payload = parse_split_header(blob)
    parts, pos, first_layer = [], 0, 0
    for i, p in enumerate(h.parts):
        part = payload[pos : pos + p.length]
        pos += p.length
        ph = parse_chunk(part)[0]
        for name in _SHARED:
            got, want = getattr(ph, name), getattr(h, name)
            if (tuple(got) if name == "resolution" else got) != want:
                raise FormatError(f"split chunk part {i} says {name}={got!r}; the chunk says {want!r}")
        if ph.layers != p.layers:
            raise FormatError(f"split chunk part {i} holds {ph.layers} layers; the chunk lists {p.layers}")
        want, first_layer = first_layer, first_layer + p.layers
        if h.layer_bits and ph.layer_bits != h.layer_bits[want:first_layer]:
            raise FormatError(f"split chunk part {i} codes layer bits {list(ph.layer_bits)}; the chunk lists others")
        if ph.layer_offset != want and (h.version >= 3 or ph.layer_offset):  # version 1, 2: offsets optional
            raise FormatError(
                f"split chunk part {i} says it starts at layer {ph.layer_offset}; its place is layer {want} "
                "(parts reordered or exchanged)"
            )
        if p.header_crc32 is not None and header_crc(part) != p.header_crc32:
            raise FormatError(f"split chunk part {i} is not the part the chunk lists there (reordered or exchanged)")
        parts.append((ph, part))
    return h, parts
