"""Per-channel centering of integer symbols (pure, lossless).

HEVC predicts a sample from its neighbours; channels quantized to different parts of the integer
range make those predictions poor. Shifting every (unit, channel) so that its typical value lands at
the middle of the range, modulo 2**bits, is a bijection on the integers and measurably shrinks the
lossless stream (see benchmarks/results/ratio-*.md).
"""

from __future__ import annotations

import torch


def channel_centers(symbols: torch.Tensor, modulus: torch.Tensor) -> torch.Tensor:
    """symbols: (units, tokens, dim) uint8; modulus: (units,) int64 (2**bits).
    Returns the per-(unit, channel) median as uint8, shape (units, dim)."""
    return symbols.median(dim=1).values.to(torch.uint8)


def center(symbols: torch.Tensor, centers: torch.Tensor, modulus: torch.Tensor) -> torch.Tensor:
    m = modulus.view(-1, 1, 1)
    shifted = symbols.long() - centers.long().unsqueeze(1) + m // 2
    return torch.remainder(shifted, m).to(torch.uint8)


def uncenter(samples: torch.Tensor, centers: torch.Tensor, modulus: torch.Tensor) -> torch.Tensor:
    """Inverse of center. samples: (units, tokens, dim); centers (units, dim); modulus (units,)."""
    m = modulus.view(-1, 1, 1).to(samples.device)
    restored = samples.long() + centers.long().unsqueeze(1) - m // 2
    return torch.remainder(restored, m).to(torch.uint8)
