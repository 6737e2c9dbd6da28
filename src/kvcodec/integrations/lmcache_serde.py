"""LMCache serde: LMCache's L2 adapters store kvcodec-coded KV.

`kvcodec.integrations.lmcache_plugin` registers the serde type "kvcodec" in
`lmcache.v1.distributed.serde` (the registry that also holds "fp8" and "turboquant"); an L2
adapter opts in with `"serde": {"type": "kvcodec", "quant": "int8"}`. Use it with
`kvcodec.integrations.lmcache_store.KVCodecStoreL2Adapter`: LMCache 0.5.6's own fs and resp
adapters cannot load objects shorter than the serde's size bound (docs/integrations/lmcache.md).

Serde options (all optional): `codec` (a registered kvcodec codec, default "hevc") and that
codec's options (for "hevc" the `kvcodec.CodecConfig` fields `quant`, `video_bits`,
`sample_coder`, `x265_preset`, `search_layout`, `layer_bits`; each object is one chunk, so not
`chunk_tokens`), `resolution` ("256x256": the one frame size objects are stored at), `head_dim`
(how LMCache's hidden dimension splits into heads; the default picks 128 or 64), `device`
("auto": NVDEC on CUDA where present, else the CPU decoder) and `max_workers` (LMCache's serde
thread pool). This module does the coding and imports nothing of LMCache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import threading
import zlib
from collections.abc import Mapping

import torch

from kvcodec.codecs import ChunkCodec, make_codec
from kvcodec.config import one_resolution, whole_number
from kvcodec.errors import ChecksumError, ConfigError, FormatError, ShapeError, TruncatedError

SERDE_NAME = "kvcodec"
_MAGIC = b"KVLM"
# 2: the object's key digest in the head, each part's dtype and CRC-32 in the table (version 1 had
# none: an object stored under another key, or a raw part damaged or of another dtype, read as data)
_VERSION = 2
_KEY_DIGEST = 16  # bytes of BLAKE2b over the object's key
_HEAD = struct.Struct(f"<4sBBH{_KEY_DIGEST}s")  # magic, version, flags (unused), number of parts, key digest
_PART = struct.Struct("<BBIQ")  # part kind (coded or raw), dtype code, CRC-32 of kind, dtype and bytes, byte length
_CODED, _RAW = 1, 2
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the codecs store (the code is the index)
_HEADROOM = 4096  # frame and header bytes beyond a part's raw size (the size bound)
_OWN = {"codec", "resolution", "head_dim", "device", "max_workers"}


@dataclasses.dataclass(frozen=True)
class SerdeOptions:
    """The serde's settings, parsed from LMCache's `"serde": {...}` dict: `codec` (a registered
    kvcodec codec, default "hevc") and its options (for "hevc": CodecConfig fields), plus the
    serde's own keys."""

    codec: str = "hevc"
    codec_options: tuple[tuple[str, object], ...] = ()
    head_dim: int | None = None
    device: str = "auto"
    max_workers: int = 1

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, object]) -> SerdeOptions:
        options = {k: v for k, v in kwargs.items() if k not in _OWN}
        if "chunk_tokens" in options or "resolutions" in options:
            raise ConfigError(
                "the kvcodec serde codes each LMCache object as one chunk at one `resolution`; "
                "chunk_tokens and resolutions are not options"
            )
        codec = str(kwargs.get("codec", "hevc"))
        if "resolution" in kwargs or codec == "hevc":
            options["resolutions"] = (one_resolution(kwargs.get("resolution", "256x256")),)
        device = str(kwargs.get("device", "auto"))
        if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
            raise ConfigError(f"kvcodec serde device must be auto, cpu or cuda[:N]; got {device!r}")
        head_dim = kwargs.get("head_dim")
        made = cls(
            codec,
            tuple(sorted(options.items())),
            None if head_dim is None else _at_least_one(head_dim, "head_dim"),
            device,
            _at_least_one(kwargs.get("max_workers", 1), "max_workers"),
        )
        made.make_codec(256)  # a bad codec name or option fails here, when LMCache builds the adapter
        return made

    def make_codec(self, tokens: int) -> ChunkCodec:
        """The codec for objects of `tokens` tokens: the whole object is one chunk."""
        return make_codec(self.codec, **dict(self.codec_options), chunk_tokens=max(1, tokens))

    def decode_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def _at_least_one(value: object, name: str) -> int:
    n = whole_number(value, f"kvcodec serde {name}")
    if n < 1:
        raise ConfigError(f"kvcodec serde {name} must be >= 1; got {value!r}")
    return n


def default_head_dim(hidden: int) -> int:
    """LMCache objects carry heads * head_dim as one hidden dimension; the codec wants them apart.
    Values and the quantizer (per channel) do not depend on the split; only the frame tiling does."""
    return next((d for d in (128, 64) if hidden % d == 0), hidden)


def to_canonical(x: torch.Tensor, head_dim: int | None) -> torch.Tensor:
    """LMCache KV (2, layers, tokens, hidden), or MLA (layers, tokens, dim), as kvcodec's
    (layers, 2, tokens, heads, head_dim). MLA's latent is cut in two halves (K and V slots): a view,
    per-channel quantization is unchanged."""
    if x.dim() == 4 and x.shape[0] == 2:
        _, layers, tokens, hidden = x.shape
        d = head_dim or default_head_dim(hidden)
        if hidden % d:
            raise ShapeError(f"hidden size {hidden} is not a multiple of head_dim {d}")
        return x.permute(1, 0, 2, 3).reshape(layers, 2, tokens, hidden // d, d)
    if x.dim() == 3:
        layers, tokens, dim = x.shape
        if dim % 2:
            raise ShapeError(f"MLA objects need an even latent size; got {dim}")
        return x.reshape(layers, tokens, 2, 1, dim // 2).permute(0, 2, 1, 3, 4)
    raise ShapeError(
        f"LMCache object shape {tuple(x.shape)}: expected (2, layers, tokens, hidden) or MLA (layers, tokens, dim)"
    )


def from_canonical(kv: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of to_canonical for an object of `shape`."""
    if len(shape) == 4:
        return kv.reshape(shape[1], 2, shape[2], shape[3]).permute(1, 0, 2, 3)
    return kv.permute(0, 2, 1, 3, 4).reshape(shape)


def object_parts(obj) -> list[torch.Tensor]:
    """The tensors of an LMCache MemoryObj, one per (shape, dtype) group."""
    shapes = obj.get_shapes()
    if len(shapes) <= 1:
        t = obj.tensor
        return [] if t is None else [t]
    return [obj.get_tensor(i) for i in range(len(shapes))]


class KVCodecCoder:
    """Codes one LMCache object: each part as one kvcodec chunk (all the object's tokens) through
    the configured ChunkCodec, or raw bytes where coding would break the size bound."""

    def __init__(self, options: SerdeOptions) -> None:
        self.options = options
        self._codecs: dict[int, ChunkCodec] = {}
        self._lock = threading.Lock()

    def codec(self, tokens: int) -> ChunkCodec:
        with self._lock:
            if tokens not in self._codecs:
                self._codecs[tokens] = self.options.make_codec(tokens)
            return self._codecs[tokens]

    def encode(self, parts: list[torch.Tensor], key: bytes) -> bytes:
        """The serialized object: `parts`, bound to `key` (the object's key, any bytes that name it)."""
        pieces = [(kind, dtype_code(p.dtype), b) for p, (kind, b) in zip(parts, map(self._encode_part, parts))]
        table = [_PART.pack(kind, dtype, _part_crc(kind, dtype, b), len(b)) for kind, dtype, b in pieces]
        head = _HEAD.pack(_MAGIC, _VERSION, 0, len(pieces), key_digest(key))
        return b"".join([head, *table, *(b for _, _, b in pieces)])

    def decode_into(self, data: memoryview, parts: list[torch.Tensor], key: bytes) -> None:
        """Decode an object into `parts`; refused (FormatError) unless it was stored under `key`."""
        stored_under, pieces = split_frame(data)
        if stored_under != key_digest(key):
            raise FormatError("kvcodec LMCache object was stored under another key (the store served the wrong object)")
        if len(pieces) != len(parts):
            raise ShapeError(f"stored object has {len(pieces)} parts; the destination has {len(parts)}")
        for (kind, dtype, blob), out in zip(pieces, parts):
            if dtype != out.dtype:  # raw bytes would be misread, a coded part cast
                raise FormatError(f"kvcodec LMCache part stored as {dtype}; the buffer is {out.dtype}")
            if kind == _RAW:
                _copy_raw(blob, out)
            else:
                self._decode_part(blob, out)

    def _encode_part(self, x: torch.Tensor) -> tuple[int, bytes]:
        kv = to_canonical(x.detach().to("cpu"), self.options.head_dim)
        blob = self.codec(kv.shape[2]).encode_chunks(kv)[0].blobs[0]
        raw_size = x.numel() * x.element_size()
        # Tiny objects can code larger than raw (side information): those are stored raw, which
        # keeps every serialized object within size_bound.
        if len(blob) > raw_size + _HEADROOM // 2:
            return _RAW, x.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        return _CODED, blob

    def _decode_part(self, blob: memoryview, out: torch.Tensor) -> None:
        view = to_canonical(out, self.options.head_dim)
        codec = self.codec(view.shape[2])
        device = self.options.decode_device()
        if device == out.device:
            codec.decode_chunk(blob, view)  # straight into LMCache's buffer
        else:  # NVDEC decodes into GPU memory; LMCache's L1 buffer is host memory
            staged = torch.empty(view.shape, dtype=view.dtype, device=device)
            view.copy_(codec.decode_chunk(blob, staged))


def key_digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=_KEY_DIGEST).digest()


def _part_crc(kind: int, dtype: int, blob: bytes | memoryview) -> int:
    return zlib.crc32(blob, zlib.crc32(bytes([kind, dtype])))


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in _DTYPES:
        raise ShapeError(f"the kvcodec LMCache serde stores {', '.join(map(str, _DTYPES))}; not {dtype}")
    return _DTYPES.index(dtype)


def split_frame(data: memoryview) -> tuple[bytes, list[tuple[int, torch.dtype, memoryview]]]:
    """The key digest of a serialized object and (kind, dtype, bytes) of each of its parts, each
    checked against its CRC-32; trailing bytes (LMCache loads into a buffer of the estimated size)
    are ignored."""
    view = memoryview(data).cast("B")
    if len(view) < _HEAD.size:
        raise TruncatedError(f"kvcodec LMCache object truncated: {len(view)} bytes")
    magic, version, _, n, stored_under = _HEAD.unpack_from(view, 0)
    if magic != _MAGIC:
        raise FormatError(f"not a kvcodec LMCache object (magic {bytes(magic)!r})")
    if version != _VERSION:
        raise FormatError(f"kvcodec LMCache object version {version}; this kvcodec reads {_VERSION}")
    pos = _HEAD.size + n * _PART.size
    if len(view) < pos:
        raise TruncatedError("kvcodec LMCache object truncated inside its part table")
    pieces = []
    for i in range(n):
        kind, dtype, crc, length = _PART.unpack_from(view, _HEAD.size + i * _PART.size)
        if kind not in (_CODED, _RAW) or dtype >= len(_DTYPES):
            raise FormatError(f"kvcodec LMCache object part {i} has unknown kind {kind} or dtype {dtype}")
        if pos + length > len(view):
            raise TruncatedError(f"kvcodec LMCache object truncated in part {i}")
        blob = view[pos : pos + length]
        if _part_crc(kind, dtype, blob) != crc:
            raise ChecksumError(f"kvcodec LMCache object part {i} fails its CRC-32")
        pieces.append((kind, _DTYPES[dtype], blob))
        pos += length
    return bytes(stored_under), pieces


def _copy_raw(blob: memoryview, out: torch.Tensor) -> None:
    if len(blob) != out.numel() * out.element_size():
        raise ShapeError(f"raw part has {len(blob)} bytes; destination holds {out.numel() * out.element_size()}")
    src = torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(out.dtype).view(out.shape)
    out.copy_(src)


def size_bound(shapes, dtypes) -> int:
    """Bytes a serialized object can take at most: raw parts plus framing (a part that codes
    larger than that is stored raw)."""
    raw = sum(torch.Size(s).numel() * d.itemsize for s, d in zip(shapes, dtypes))
    return raw + _HEADROOM * max(1, len(shapes))
