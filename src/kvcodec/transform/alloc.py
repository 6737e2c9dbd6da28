"""Bit allocation by reverse water-filling.

For coefficients of variance lambda_i coded by a uniform quantizer with entropy coding, the
mean squared error at a rate budget is minimised by one distortion level theta for every
coordinate: coordinates with lambda_i > theta get step sqrt(12 theta) (the Gaussian
rate 0.5 log2(lambda_i / theta); a real uniform quantizer spends about 0.25 bit more per coded
coordinate, which the codec's size search on the actual data absorbs), the others get 0 bits (they are dropped and restored as
their mean). A weight w_i > 1 asks for w_i times less error on coordinate i.
"""

from __future__ import annotations

import math

import torch

from kvcodec.errors import ConfigError

QUANTIZER_EXTRA_BITS = 0.25  # a uniform quantizer's bits beyond the Gaussian rate per coded coordinate (high rate)


def coordinate_bits(
    variances: torch.Tensor, theta: float, weights: torch.Tensor | None = None, extra_bits: float = 0.0
) -> torch.Tensor:
    """Modelled bits of each coordinate at distortion level theta (0 where lambda_i w_i <= theta),
    plus extra_bits for each coded one."""
    v = variances.to(torch.float64) * (1.0 if weights is None else weights.to(torch.float64))
    bits = 0.5 * torch.log2(v.clamp_min(1e-300) / theta)
    return torch.where(v > theta, bits + extra_bits, torch.zeros_like(bits))


def steps_for(variances: torch.Tensor, theta: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Quantizer step per coordinate (float64); 0 marks a dropped (0-bit) coordinate."""
    if not theta > 0:
        raise ConfigError(f"distortion level must be > 0; got {theta}")
    w = torch.ones_like(variances, dtype=torch.float64) if weights is None else weights.to(torch.float64)
    step = torch.sqrt(12.0 * theta / w)
    return torch.where(variances.to(torch.float64) * w > theta, step, torch.zeros_like(step))


def water_level(
    variances: torch.Tensor,
    bits_per_value: float,
    weights: torch.Tensor | None = None,
    iters: int = 100,
    extra_bits: float = 0.0,
) -> float:
    """The distortion level theta at which the modelled mean bits per coordinate equal
    bits_per_value (bisection on log theta); extra_bits: the model's bits for each coded
    coordinate beyond the Gaussian rate (QUANTIZER_EXTRA_BITS models a real quantizer's)."""
    if not bits_per_value > 0 or not math.isfinite(bits_per_value):
        raise ConfigError(f"bits per value must be a positive number; got {bits_per_value}")
    v = variances.to(torch.float64)
    if v.numel() == 0 or not torch.isfinite(v).all() or float(v.max()) <= 0:
        raise ConfigError("bit allocation needs finite variances, at least one of them positive")
    w = torch.ones_like(v) if weights is None else weights.to(torch.float64)
    top = float((v * w).max())
    lo, hi = math.log(top) - 200.0, math.log(top)  # rate(hi) = 0 < budget
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if float(coordinate_bits(v, math.exp(mid), w, extra_bits).mean()) > bits_per_value:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)
