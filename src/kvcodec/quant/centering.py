"""Per-channel centering of integer symbols (pure, lossless).

HEVC predicts a sample from its neighbours; channels quantized to different parts of the integer
range make those predictions poor. Shifting every (unit, channel) so that its typical value lands at
the middle of the range, modulo 2**bits, is a bijection on the integers and measurably shrinks the
lossless stream (see benchmarks/results/ratio-*.md).
"""

from __future__ import annotations

import numpy as np
import torch


def channel_centers(symbols: torch.Tensor, modulus: torch.Tensor) -> torch.Tensor:
    """symbols: (units, tokens, dim) uint8; modulus: (units,) int64 (2**bits).
    Returns the per-(unit, channel) median as uint8, shape (units, dim): the lower of the two
    middle values for an even count, as torch.median."""
    if symbols.device.type != "cpu":
        return symbols.median(dim=1).values.to(torch.uint8)
    # numpy sorts uint8 by radix (kind="stable"): several times faster than torch.median here
    rows = np.ascontiguousarray(symbols.numpy().transpose(0, 2, 1))
    middle = (rows.shape[2] - 1) // 2
    return torch.from_numpy(np.sort(rows, axis=2, kind="stable")[:, :, middle].copy())


def center(symbols: torch.Tensor, centers: torch.Tensor, modulus: torch.Tensor) -> torch.Tensor:
    """(symbols - centers + modulus / 2) mod modulus per unit, in wrapping uint8 arithmetic (every
    modulus divides 256): no wide temporaries."""
    m = modulus.to(centers.device).long()
    shift = torch.remainder((m // 2).unsqueeze(1) - centers.long(), 256).to(torch.uint8).unsqueeze(1)
    mask = (m - 1).to(torch.uint8).view(-1, 1, 1)
    return (symbols.to(torch.uint8) + shift).bitwise_and_(mask)


def uncenter(samples: torch.Tensor, centers: torch.Tensor, modulus: torch.Tensor) -> torch.Tensor:
    """Inverse of center. samples: (units, tokens, dim); centers (units, dim); modulus (units,)."""
    shift, mask = uncenter_terms(centers, modulus)
    return uncenter_with(samples, shift, mask)


def uncenter_terms(centers: torch.Tensor, modulus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(unit, channel) uint8 shift and per-unit uint8 mask such that
    uncenter(s) == (s + shift) & mask in wrapping uint8 arithmetic (every modulus divides 256)."""
    m = modulus.to(centers.device).long()
    shift = torch.remainder(centers.long() - (m // 2).unsqueeze(1), 256).to(torch.uint8)
    mask = (m - 1).to(torch.uint8).view(-1, 1, 1)
    return shift.unsqueeze(1), mask


def uncenter_with(samples: torch.Tensor, shift: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """uint8 only, no wide temporaries: the restore path runs this once per decoded frame."""
    return (samples + shift).bitwise_and_(mask)
