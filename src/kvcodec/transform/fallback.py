"""Never worse than the simple thing: per (layer group, K|V), the decorrelating basis is kept only
where, on held-out calibration tokens, it codes better than per-channel quantization of the same
size; elsewhere the group falls back to a diagonal basis (each channel quantized on its own, with the
same water-filled step, mean and weights). A diagonal basis is an ordinary .kvt basis (a scaled
permutation), so the codec and every restore path code it unchanged.

"Better" is the rate-distortion Lagrangian J = D + lambda R measured on the held-out tokens with the
codec's own quantizer: D the (weighted) squared error per token, R the order-0 entropy of the integers
per token (rate.column_entropy_bits), lambda = 2 ln 2 theta (the slope of D(R) where every coded
coordinate has error theta), summed over the distortion levels of a few target ratios.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvcodec.transform import alloc, rate
from kvcodec.transform.calibration import GroupBasis

FALLBACK_RATIOS = (3.0, 5.0, 8.0)  # the ratios (vs fp16) whose distortion levels the comparison uses


def diagonal_basis(x: torch.Tensor, w: torch.Tensor | None) -> GroupBasis:
    """Per-channel coding of samples x (n, d): mean, a permutation (channels by weighted variance,
    descending) scaled by 1/sqrt(w), and those variances."""
    x = x.to(torch.float64)
    mean = x.mean(0)
    ww = torch.ones(x.shape[1], dtype=torch.float64) if w is None else w.to(torch.float64)
    var = (x - mean).pow(2).mean(0) * ww
    order = torch.argsort(var, descending=True, stable=True)
    basis = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
    basis[order, torch.arange(x.shape[1])] = 1.0 / ww[order].sqrt()
    return GroupBasis(mean.float(), basis.float(), var[order].float(), None if w is None else w.float())


def lagrangian(b: GroupBasis, x: torch.Tensor, theta: float) -> float:
    """J = D + 2 ln2 theta R per token of the basis coding held-out samples x (n, d) at level theta."""
    y = (x.to(torch.float32) - b.mean) @ b.analysis
    steps = alloc.steps_for(b.variances, theta).to(torch.float32)
    n = int((steps > 0).sum())
    if n:
        q = torch.round(y[:, :n] / steps[:n])
        err = (y[:, :n] - q * steps[:n]).pow(2).sum() + y[:, n:].pow(2).sum()
        bits = rate.column_entropy_bits(q.to(torch.int64))
    else:
        err, bits = y.pow(2).sum(), 0.0
    return (float(err) + 2 * math.log(2) * theta * bits) / x.shape[0]


def levels(variances: torch.Tensor, ratios: Sequence[float] = FALLBACK_RATIOS) -> list[float]:
    """The distortion levels at which the modelled rate of all coordinates is 16 / ratio bits per value."""
    return [alloc.water_level(variances, 16.0 / r) for r in ratios]


def prefer_diagonal(fitted: GroupBasis, diagonal: GroupBasis, held_out: torch.Tensor, thetas: Sequence[float]) -> bool:
    """True when per-channel coding beats the fitted basis on held-out samples (summed J over thetas)."""
    return sum(lagrangian(diagonal, held_out, t) for t in thetas) < sum(lagrangian(fitted, held_out, t) for t in thetas)
