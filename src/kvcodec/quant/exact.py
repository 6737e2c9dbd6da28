"""Bit-exact byte planes of floating-point KV (pure functions).

Each value's bit pattern is split into sign and magnitude. The top byte of the magnitude (the
exponent and the top mantissa bits) is smooth per channel and goes through HEVC as the 8-bit
sample; the remaining magnitude bits, followed by the sign bit, are near-random and go through a
byte coder. (An ordered, sign-folded code puts +1 and -1 about 120 codes apart in the top byte,
which cost HEVC 8.9 bits per value on real KV; the magnitude byte costs 6.0: see
benchmarks/results/ratio-*.md.) The split is a bijection on bit patterns, NaNs and infinities
included.
"""

from __future__ import annotations

import torch

_WIDTH = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32}
_INT_VIEW = {16: torch.int16, 32: torch.int32}


def bytes_per_value(dtype: torch.dtype) -> int:
    return _WIDTH[dtype] // 8


def _unsigned(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    bits = _WIDTH[x.dtype]
    return x.contiguous().view(_INT_VIEW[bits]).to(torch.int64) & ((1 << bits) - 1), bits


def split_bytes(x: torch.Tensor) -> list[torch.Tensor]:
    """[top magnitude byte, then (low magnitude bits << 1 | sign) as bytes, most significant first],
    each uint8 with x's shape."""
    u, bits = _unsigned(x)
    low_bits = bits - 9  # magnitude bits below the top byte
    sign = u >> (bits - 1)
    magnitude = u & ((1 << (bits - 1)) - 1)
    top = magnitude >> low_bits
    rest = ((magnitude & ((1 << low_bits) - 1)) << 1) | sign  # bits - 8 bits
    n = bytes_per_value(x.dtype)
    planes = [top.to(torch.uint8)]
    planes += [((rest >> (8 * (n - 2 - i))) & 0xFF).to(torch.uint8) for i in range(n - 1)]
    return planes


def join_bytes(planes: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Inverse of split_bytes."""
    bits = _WIDTH[dtype]
    n = bits // 8
    if len(planes) != n:
        raise ValueError(f"{dtype} needs {n} byte planes, got {len(planes)}")
    rest = torch.zeros(planes[0].shape, dtype=torch.int64, device=planes[0].device)
    for i, p in enumerate(planes[1:]):
        rest |= p.to(torch.int64) << (8 * (n - 2 - i))
    sign = rest & 1
    magnitude = (planes[0].to(torch.int64) << (bits - 9)) | (rest >> 1)
    v = magnitude | (sign << (bits - 1))
    v = torch.where(v >= (1 << (bits - 1)), v - (1 << bits), v)  # to signed
    return v.to(_INT_VIEW[bits]).view(dtype)
