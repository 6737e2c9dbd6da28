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
    return diagonal_from_moments(mean, (x - mean).pow(2).mean(0), w)


def diagonal_from_moments(mean: torch.Tensor, var: torch.Tensor, w: torch.Tensor | None) -> GroupBasis:
    """diagonal_basis from the samples' mean and (population) variance per channel."""
    mean, var = mean.to(torch.float64), var.to(torch.float64).clamp_min(0.0)
    ww = torch.ones_like(var) if w is None else w.to(torch.float64)
    var = var * ww
    order = torch.argsort(var, descending=True, stable=True)
    basis = torch.zeros(var.shape[0], var.shape[0], dtype=torch.float64)
    basis[order, torch.arange(var.shape[0])] = 1.0 / ww[order].sqrt()
    return GroupBasis(mean.float(), basis.float(), var[order].float(), None if w is None else w.float())


def lagrangian(b: GroupBasis, x: torch.Tensor, theta: float, y: torch.Tensor | None = None) -> float:
    """J = D + 2 ln2 theta R per token of the basis coding held-out samples x (n, d) at level theta
    (y: their coefficients, when already computed)."""
    y = coefficients(b, x) if y is None else y
    steps = alloc.steps_for(b.variances, theta).to(torch.float32)
    n = int((steps > 0).sum())
    if n:
        q = torch.round(y[:, :n] / steps[:n])
        err = (y[:, :n] - q * steps[:n]).pow(2).sum() + y[:, n:].pow(2).sum()
        bits = rate.column_entropy_bits(q.to(torch.int64))
    else:
        err, bits = y.pow(2).sum(), 0.0
    return (float(err) + 2 * math.log(2) * theta * bits) / x.shape[0]


def coefficients(b: GroupBasis, x: torch.Tensor) -> torch.Tensor:
    """y = analysis^T (x - mean) of samples x (n, d); a diagonal basis (one nonzero per column) gathers."""
    c = x.to(torch.float32) - b.mean
    a = b.analysis
    nz = (a != 0).sum(0)
    if bool((nz == 1).all()):
        rows = a.abs().argmax(0)
        return c[:, rows] * a[rows, torch.arange(a.shape[1])]
    return c @ a


def levels(variances: torch.Tensor, ratios: Sequence[float] = FALLBACK_RATIOS) -> list[float]:
    """The distortion levels at which the modelled rate of all coordinates is 16 / ratio bits per value."""
    return [alloc.water_level(variances, 16.0 / r) for r in ratios]


def prefer_diagonal(fitted: GroupBasis, diagonal: GroupBasis, held_out: torch.Tensor, thetas: Sequence[float]) -> bool:
    """True when per-channel coding beats the fitted basis on held-out samples (summed J over thetas)."""
    yd, yf = coefficients(diagonal, held_out), coefficients(fitted, held_out)
    return sum(lagrangian(diagonal, held_out, t, yd) for t in thetas) < sum(
        lagrangian(fitted, held_out, t, yf) for t in thetas
    )
