"""Measured rate of quantized coefficients: per-coordinate order-0 entropy, and the distortion
level that meets a byte budget on the actual data."""

from __future__ import annotations

import math

import torch

from kvcodec.errors import ConfigError

ESCAPE_BITS = 64.0  # an escape costs its index and its value


def column_entropy_bits(q: torch.Tensor) -> float:
    """Total order-0 bits of integer columns q (tokens, coords), each column its own model,
    values outside [-128, 127] counted as escapes."""
    t, c = q.shape
    if q.numel() == 0:
        return 0.0
    shifted = q.to(torch.int64) + 128
    escapes = int(((shifted < 0) | (shifted > 255)).sum())
    idx = shifted.clamp(0, 255) + 256 * torch.arange(c, device=q.device)[None, :]
    counts = torch.bincount(idx.reshape(-1), minlength=256 * c).view(c, 256).to(torch.float64)
    p = counts / t
    h = -(p * torch.log2(p.clamp_min(1e-300))).sum(1)
    return float(h.sum()) * t + ESCAPE_BITS * escapes


def solve_level(size_bits, target_bits: float, lo: float, hi: float, iters: int = 30) -> float:
    """The smallest distortion level theta in [lo, hi] whose size_bits(theta) (decreasing in
    theta) is at most target_bits; hi if none is small enough, bisection on log theta."""
    if not target_bits > 0:
        raise ConfigError(f"size target must be > 0 bits; got {target_bits}")
    a, b = math.log(lo), math.log(hi)
    if size_bits(lo) <= target_bits:
        return lo
    for _ in range(iters):
        mid = 0.5 * (a + b)
        if size_bits(math.exp(mid)) > target_bits:
            a = mid
        else:
            b = mid
    return math.exp(b)
