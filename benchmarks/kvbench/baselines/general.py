"""General-purpose baselines on the CPU: raw bits, zstd and lz4 (plain or on byte planes), and
"quantize, then zstd" on the same per-channel integers that kvcodec's integer modes code as video.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from kvbench.baselines.base import (
    Header,
    bits_to_kv,
    check_kv,
    kv_bits,
    pack,
    shuffle_bytes,
    unpack,
    unshuffle_bytes,
)
from kvcodec.errors import ConfigError, CorruptStreamError


class RawCodec:
    """Identity: the KV bits as they are (what LMCache and Mooncake ship by default)."""

    lossless = True

    def __init__(self, name: str = "raw") -> None:
        self.name = name

    @staticmethod
    def is_available() -> bool:
        return True

    def encode(self, kv: torch.Tensor) -> bytes:
        check_kv(kv)
        return pack(self.name, kv, kv_bits(kv).tobytes())

    def decode(self, data: bytes, device: str | torch.device = "cpu") -> torch.Tensor:
        header, payload = unpack(data, self.name)
        return bits_to_kv(payload, header, device)


def _zstd_compress(raw: bytes | np.ndarray, level: int, threads: int = 0) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True).compress(memoryview(raw))


def _zstd_decompress(data: bytes | memoryview, size: int) -> bytes:
    import zstandard

    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
    except zstandard.ZstdError as e:
        raise CorruptStreamError(f"zstd stream does not decode: {e}") from e
    if len(out) != size:
        raise CorruptStreamError(f"zstd stream decoded to {len(out)} bytes, expected {size}")
    return out


def _lz4_compress(raw: bytes | np.ndarray, level: int) -> bytes:
    import lz4.frame

    return lz4.frame.compress(memoryview(raw), compression_level=level, store_size=True, content_checksum=True)


def _lz4_decompress(data: bytes | memoryview, size: int) -> bytes:
    import lz4.frame

    try:
        out = lz4.frame.decompress(bytes(data))
    except RuntimeError as e:
        raise CorruptStreamError(f"lz4 frame does not decode: {e}") from e
    if len(out) != size:
        raise CorruptStreamError(f"lz4 frame decoded to {len(out)} bytes, expected {size}")
    return out


_BACKENDS = {
    "zstd": (_zstd_compress, _zstd_decompress),
    "lz4": (_lz4_compress, _lz4_decompress),
}


class ByteCodec:
    """zstd or lz4 on the KV bits, optionally after a byte-plane shuffle. Bit-exact."""

    lossless = True

    def __init__(self, name: str, backend: str, level: int, shuffle: bool = False) -> None:
        if backend not in _BACKENDS:
            raise ConfigError(f"unknown byte compressor {backend!r}")
        self.name = name
        self.backend = backend
        self.level = level
        self.shuffle = shuffle

    @staticmethod
    def is_available() -> bool:
        return True

    def encode(self, kv: torch.Tensor) -> bytes:
        check_kv(kv)
        raw = kv_bits(kv)
        if self.shuffle:
            raw = shuffle_bytes(raw, kv.element_size())
        return pack(self.name, kv, _BACKENDS[self.backend][0](np.ascontiguousarray(raw), self.level))

    def decode(self, data: bytes, device: str | torch.device = "cpu") -> torch.Tensor:
        header, payload = unpack(data, self.name)
        raw = np.frombuffer(_BACKENDS[self.backend][1](payload, header.numel * header.itemsize), dtype=np.uint8)
        if self.shuffle:
            raw = unshuffle_bytes(raw, header.itemsize)
        return bits_to_kv(raw, header, device)


# --- quantize-then-entropy-code --------------------------------------------------------------------


def minmax_quantize(kv: torch.Tensor, bits: int, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel min-max integer quantization, the scheme of kvcodec's integer modes.

    Parameters are computed per (layer, K/V, head, channel) over each chunk of `chunk_tokens`
    tokens. Returns (q uint8 (layers, 2, tokens, heads, dim), offset, step), offset/step of shape
    (chunks, layers, 2, heads, dim). Uses kvcodec.quant.integer when it is importable (so the
    integers are exactly those kvcodec codes as video), else the same math with fp32 parameters.
    """
    n_tok = kv.shape[2]
    qs, offs, steps = [], [], []
    for s in range(0, n_tok, chunk_tokens):
        x = kv[:, :, s : s + chunk_tokens]
        q, off, st = _quantize_chunk(x, bits)
        qs.append(q)
        offs.append(off.float())
        steps.append(st.float())
    return torch.cat(qs, dim=2), torch.stack(offs), torch.stack(steps)


def _quantize_chunk(x: torch.Tensor, bits: int):
    try:
        from kvcodec.quant import integer as kq
    except ImportError:
        kq = None
    if kq is not None and hasattr(kq, "minmax_params") and hasattr(kq, "quantize"):
        b = torch.full((x.shape[0],), bits, dtype=torch.int64)
        off, st = kq.minmax_params(x, b)
        return kq.quantize(x, off, st, b), off, st
    return _quantize_chunk_fallback(x, bits)


def _quantize_chunk_fallback(x: torch.Tensor, bits: int):
    xf = x.float()
    lo = xf.amin(dim=2)
    hi = xf.amax(dim=2)
    n = float((1 << bits) - 1)
    step = (hi - lo) / n
    step = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round((xf - lo.unsqueeze(2)) / step.unsqueeze(2)).clamp_(0, n).to(torch.uint8)
    return q, lo, step


def minmax_dequantize(
    q: torch.Tensor, offset: torch.Tensor, step: torch.Tensor, chunk_tokens: int, dtype
) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for c in range(offset.shape[0]):
        s = c * chunk_tokens
        sl = slice(s, s + chunk_tokens)
        out[:, :, sl] = offset[c].unsqueeze(2) + q[:, :, sl].float() * step[c].unsqueeze(2)
    return out.to(dtype)


_QPARAMS = struct.Struct("<BII")  # bits, chunk_tokens, compressed length of the integer block


class QuantZstdCodec:
    """Per-channel min-max integers (kvcodec's integer modes), one symbol per byte, then zstd.

    Lossy: |x - decode(encode(x))| <= step / 2 per channel (plus the output dtype's rounding).
    The integer block and the fp32 parameters are zstd-compressed separately.
    """

    lossless = False

    def __init__(self, name: str, bits: int = 8, level: int = 19, chunk_tokens: int = 256) -> None:
        if not 1 <= bits <= 8:
            raise ConfigError(f"bits must be in 1..8; got {bits}")
        self.name = name
        self.bits = bits
        self.level = level
        self.chunk_tokens = chunk_tokens

    @staticmethod
    def is_available() -> bool:
        return True

    def encode(self, kv: torch.Tensor) -> bytes:
        check_kv(kv)
        q, off, st = minmax_quantize(kv.detach().cpu(), self.bits, self.chunk_tokens)
        qz = _zstd_compress(q.contiguous().numpy(), self.level)
        pz = _zstd_compress(torch.stack([off, st]).contiguous().numpy(), self.level)
        return pack(self.name, kv, _QPARAMS.pack(self.bits, self.chunk_tokens, len(qz)) + qz + pz)

    def decode(self, data: bytes, device: str | torch.device = "cpu") -> torch.Tensor:
        header, payload = unpack(data, self.name)
        q, off, st, chunk = self.decode_integers(header, payload)
        return minmax_dequantize(q.to(device), off.to(device), st.to(device), chunk, header.dtype)

    @staticmethod
    def decode_integers(header: Header, payload: memoryview):
        if len(payload) < _QPARAMS.size:
            raise CorruptStreamError("quantized payload shorter than its parameters")
        bits, chunk, qlen = _QPARAMS.unpack_from(payload, 0)
        if chunk < 1 or _QPARAMS.size + qlen > len(payload):
            raise CorruptStreamError("quantized payload lengths are inconsistent")
        L, _, T, H, D = header.shape
        q = np.frombuffer(_zstd_decompress(payload[_QPARAMS.size : _QPARAMS.size + qlen], header.numel), np.uint8)
        nchunks = -(-T // chunk)
        psize = 2 * nchunks * L * 2 * H * D * 4
        p = np.frombuffer(_zstd_decompress(payload[_QPARAMS.size + qlen :], psize), np.float32)
        p = torch.from_numpy(p.copy()).reshape(2, nchunks, L, 2, H, D)
        return torch.from_numpy(q.copy()).reshape(header.shape), p[0], p[1], chunk


def zstd_size_of_integers(q: np.ndarray | torch.Tensor, level: int = 19) -> int:
    """Bytes zstd needs for an integer block (one symbol per byte): to compare HEVC and zstd on the
    exact integers a kvcodec integer mode produced."""
    if isinstance(q, torch.Tensor):
        q = q.detach().cpu().contiguous().numpy()
    return len(_zstd_compress(np.ascontiguousarray(q), level))
