"""What every baseline shares: the `TensorCoder` shape of a whole-tensor baseline (the building
block that kvbench.baselines.chunk turns into a kvcodec ChunkCodec), KV tensor checks and the small
container each baseline wraps its payload in.

Container layout (little endian)::

    magic    4s   b"KVBL"
    version  u8   1
    dtype    u8   1 = float16, 2 = bfloat16, 3 = float32
    ndim     u8   always 5 for the canonical KV tensor
    namelen  u8   length of the codec name that follows
    name     namelen bytes (ASCII): the registry name of the codec that wrote the payload
    shape    ndim x u32
    paylen   u64  payload length in bytes
    crc      u32  CRC-32 of every header byte before it and of the payload
    payload  paylen bytes, the codec's own format

A bad magic or version raises FormatError, a short buffer TruncatedError, a CRC mismatch
ChecksumError; a payload that passes the CRC but does not decode to what the header announces
raises CorruptStreamError. Decoding with a different codec than the one that wrote the bytes is a
FormatError.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from kvcodec.errors import ChecksumError, CorruptStreamError, FormatError, ShapeError, TruncatedError

MAGIC = b"KVBL"
VERSION = 1

DTYPE_CODES: dict[torch.dtype, int] = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
CODE_DTYPES: dict[int, torch.dtype] = {v: k for k, v in DTYPE_CODES.items()}
# Integer views with the same width: how raw bits of each float dtype travel through numpy.
BITS_VIEW: dict[torch.dtype, torch.dtype] = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
}

_FIXED = struct.Struct("<4sBBBB")
_TAIL = struct.Struct("<QI")


@runtime_checkable
class TensorCoder(Protocol):
    """A baseline's coder of a whole canonical KV tensor `(layers, 2, tokens, kv_heads, head_dim)`.
    Not a codec of its own: the fetcher and the benchmarks use it through BaselineCodec, the
    ChunkCodec that codes each chunk with it. `lossless` coders restore every bit; lossy ones
    document their error bound."""

    name: str
    lossless: bool

    def encode(self, kv: torch.Tensor) -> bytes: ...

    def decode(self, data: bytes, device: str | torch.device = "cpu") -> torch.Tensor: ...


def check_kv(kv: torch.Tensor) -> None:
    """Raise ShapeError unless kv is a canonical KV tensor of a supported float dtype."""
    if not isinstance(kv, torch.Tensor):
        raise ShapeError(f"expected a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ShapeError(f"expected a KV tensor (layers, 2, tokens, kv_heads, head_dim); got shape {tuple(kv.shape)}")
    if kv.dtype not in DTYPE_CODES:
        raise ShapeError(f"KV dtype must be float16, bfloat16 or float32; got {kv.dtype}")
    if kv.numel() == 0:
        raise ShapeError(f"empty KV tensor of shape {tuple(kv.shape)}")


@dataclass(frozen=True)
class Header:
    codec: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def pack(codec: str, kv: torch.Tensor, payload: bytes | bytearray | memoryview) -> bytes:
    """Wrap a codec's payload in the checked container."""
    name = codec.encode("ascii")
    if len(name) > 255:
        raise ValueError("codec name too long")
    head = (
        _FIXED.pack(MAGIC, VERSION, DTYPE_CODES[kv.dtype], kv.dim(), len(name))
        + name
        + struct.pack(f"<{kv.dim()}I", *kv.shape)
    )
    payload = bytes(payload)
    head += struct.pack("<Q", len(payload))
    crc = zlib.crc32(payload, zlib.crc32(head))
    return head + struct.pack("<I", crc) + payload


def unpack(data: bytes | bytearray | memoryview, codec: str | None = None) -> tuple[Header, memoryview]:
    """Check a container and return its header and a view of the payload.

    codec: when given, the bytes must have been written by the codec of that name.
    """
    buf = memoryview(bytes(data) if not isinstance(data, (bytes, memoryview)) else data)
    if len(buf) < _FIXED.size:
        if bytes(buf[: len(MAGIC)]) != MAGIC[: len(buf)]:
            raise FormatError("not a kvcodec baseline container (bad magic)")
        raise TruncatedError(f"container of {len(buf)} bytes is shorter than its fixed header")
    magic, version, dcode, ndim, namelen = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise FormatError("not a kvcodec baseline container (bad magic)")
    if version != VERSION:
        raise FormatError(f"baseline container version {version} is not supported (this build reads {VERSION})")
    if dcode not in CODE_DTYPES:
        raise FormatError(f"unknown dtype code {dcode}")
    off = _FIXED.size
    need = off + namelen + 4 * ndim + _TAIL.size
    if len(buf) < need:
        raise TruncatedError(f"container of {len(buf)} bytes ends inside its header ({need} bytes)")
    try:
        name = bytes(buf[off : off + namelen]).decode("ascii")
    except UnicodeDecodeError as e:
        raise FormatError("codec name in header is not ASCII") from e
    off += namelen
    shape = struct.unpack_from(f"<{ndim}I", buf, off)
    off += 4 * ndim
    paylen, crc = _TAIL.unpack_from(buf, off)
    head_end = off + 8
    off += _TAIL.size
    if len(buf) < off + paylen:
        raise TruncatedError(f"container announces {paylen} payload bytes, {len(buf) - off} present")
    if len(buf) > off + paylen:
        raise FormatError(f"{len(buf) - off - paylen} trailing bytes after the payload")
    payload = buf[off : off + paylen]
    if zlib.crc32(payload, zlib.crc32(buf[:head_end])) != crc:
        raise ChecksumError("baseline container checksum mismatch")
    if codec is not None and name != codec:
        raise FormatError(f"bytes were written by codec {name!r}, not {codec!r}")
    if ndim != 5 or shape[1] != 2 or 0 in shape:
        raise FormatError(f"header shape {shape} is not a KV tensor shape")
    return Header(name, CODE_DTYPES[dcode], tuple(shape)), payload


def kv_bits(kv: torch.Tensor) -> np.ndarray:
    """The raw bits of kv as a contiguous little-endian numpy integer array (CPU copy)."""
    return kv.detach().contiguous().cpu().view(BITS_VIEW[kv.dtype]).numpy()


def bits_to_kv(raw: bytes | bytearray | memoryview | np.ndarray, header: Header, device) -> torch.Tensor:
    """Inverse of kv_bits: rebuild the tensor the header announces from its raw bytes."""
    view = BITS_VIEW[header.dtype]
    arr = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.view(np.uint8)
    if arr.size != header.numel * header.itemsize:
        raise CorruptStreamError(f"decoded {arr.size} bytes, header announces {header.numel * header.itemsize}")
    t = torch.from_numpy(arr.copy()).view(view).view(header.dtype).reshape(header.shape)
    return t.to(device)


def shuffle_bytes(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte-plane shuffle: all first bytes of each element, then all second bytes, ... (the
    blosc/HDF5 'shuffle' filter). Low bytes (noisy mantissa) and high bytes (sign, exponent) land in
    separate planes so a general-purpose compressor sees the redundancy of the exponent bytes."""
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, itemsize)
    return np.ascontiguousarray(b.T).reshape(-1)


def unshuffle_bytes(planes: np.ndarray, itemsize: int) -> np.ndarray:
    b = np.ascontiguousarray(planes).view(np.uint8).reshape(itemsize, -1)
    return np.ascontiguousarray(b.T).reshape(-1)
