"""Bit-exact byte planes of floating-point KV (pure functions).

Each value's bit pattern is mapped to an *ordered* unsigned integer (monotone in the float value,
so that -0.001 and +0.001 land next to each other), then split into bytes, most significant first.
The top byte (sign, exponent, top mantissa bits) is smooth and goes through HEVC; the low bytes are
near-random mantissa bits and go through a byte coder. The mapping is a bijection on bit patterns,
NaNs and infinities included.
"""

from __future__ import annotations

import torch

_WIDTH = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32}
_INT_VIEW = {16: torch.int16, 32: torch.int32}


def bytes_per_value(dtype: torch.dtype) -> int:
    return _WIDTH[dtype] // 8


def to_ordered(x: torch.Tensor) -> torch.Tensor:
    """Float tensor -> int64 tensor of ordered unsigned codes in [0, 2**bits)."""
    bits = _WIDTH[x.dtype]
    v = x.contiguous().view(_INT_VIEW[bits]).to(torch.int64) & ((1 << bits) - 1)
    sign = v >> (bits - 1)
    mask = (1 << bits) - 1
    return torch.where(sign == 1, v ^ mask, v | (1 << (bits - 1)))


def from_ordered(u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    bits = _WIDTH[dtype]
    mask = (1 << bits) - 1
    top = u >> (bits - 1)
    v = torch.where(top == 1, u & ~(1 << (bits - 1)) & mask, u ^ mask)
    v = torch.where(v >= (1 << (bits - 1)), v - (1 << bits), v)  # to signed
    return v.to(_INT_VIEW[bits]).view(dtype)


def split_bytes(x: torch.Tensor) -> list[torch.Tensor]:
    """Byte planes of the ordered codes, most significant first, each uint8 with x's shape."""
    u = to_ordered(x)
    n = bytes_per_value(x.dtype)
    return [((u >> (8 * (n - 1 - i))) & 0xFF).to(torch.uint8) for i in range(n)]


def join_bytes(planes: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    n = bytes_per_value(dtype)
    if len(planes) != n:
        raise ValueError(f"{dtype} needs {n} byte planes, got {len(planes)}")
    u = torch.zeros(planes[0].shape, dtype=torch.int64, device=planes[0].device)
    for i, p in enumerate(planes):
        u |= p.to(torch.int64) << (8 * (n - 1 - i))
    return from_ordered(u, dtype)
