"""The inverse transform every decoder computes: the decode basis and the per-block GEMM.

The decode basis of a block (group of layers, K or V) is its calibrated basis columns scaled by
the coordinates' steps, rounded to float16 under a power-of-two block scale (half_basis). Every
restore path uses it: the per-block reference here, the batched GPU kernels (restore.transform_kernels,
whose float16 GEMM then multiplies it with the integers exactly) and the calibration report's
simulation. The rounding moves a term by at most 2^-11 of itself; the quantization it follows
moves each term by up to half a step, so the decoded KV's error is unchanged to within a few
parts in 10^5 of its MSE (benchmarks/results/decode-h200-transform-llama8b-half.md).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from kvcodec.transform.calibration import KINDS, Calibration

HALF_MAX = 2048  # |q| up to which float16 holds the integers exactly


def half_basis(scaled: torch.Tensor) -> tuple[torch.Tensor, float]:
    """A block's decode basis: (float16 values, power-of-two scale) with every |value| <= 1, so
    that values * scale is the block rounded to float16's 11 significant bits (values below 2^-14
    of the scale to a multiple of 2^-24 of it). With integers |q| <= HALF_MAX (exact in float16)
    every product of a float16 GEMM is exact in float32."""
    top = float(scaled.abs().max()) if scaled.numel() else 0.0
    scale = math.ldexp(1.0, math.frexp(top)[1]) if top > 0 else 1.0
    return (scaled.to(torch.float64) / scale).to(torch.float16), scale


@dataclasses.dataclass(frozen=True)
class DecodeBlock:
    """One block's (group j // 2, kind j % 2) part of the decode basis."""

    mean: torch.Tensor  # (rows,) float32
    half: torch.Tensor  # (rows, n) float16 values; the basis is half * scale
    scale: float  # power of two

    @property
    def basis(self) -> torch.Tensor:
        """(rows, n) float32: the decode basis itself (exact: a float16 value times a power of two)."""
        return (self.half.to(torch.float64) * self.scale).float()


def decode_bases(cal: Calibration, counts, steps: torch.Tensor) -> list[DecodeBlock]:
    """Every block's decode basis, block j coding counts[j] coordinates; steps (C,) in the
    coordinates' concatenated order."""
    out, off = [], 0
    for j in range(2 * len(cal.groups)):
        b, n = cal.basis(j // 2, KINDS[j % 2]), int(counts[j])
        half, scale = half_basis(b.basis[:, :n].to(torch.float64) * steps[off : off + n].to(torch.float64))
        out.append(DecodeBlock(b.mean.float(), half, scale))
        off += n
    return out


def inverse(cal: Calibration, bases, units: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """KV (L, 2, t, H, D) float32 before RoPE from coefficients in steps `units` (C, t), concatenated
    order; bases: (mean, basis) of each block (DecodeBlock's), on units' device."""
    L, H, D = shape
    t = units.shape[1]
    x = torch.empty((L, 2, t, H, D), dtype=torch.float32, device=units.device)
    off = 0
    for j, (mean, basis) in enumerate(bases):
        layers, n = cal.groups[j // 2], basis.shape[1]
        xg = torch.addmm(mean[:, None], basis, units[off : off + n]) if n else mean[:, None].expand(-1, t)
        x[list(layers), j % 2] = xg.T.reshape(t, len(layers), H, D).permute(1, 0, 2, 3)
        off += n
    return x
