"""Never worse than the simple thing: per (layer group, K|V), the decorrelating basis is kept only
where, on held-out calibration tokens, it is at least as accurate as per-channel integer
quantization of the same or fewer bytes; elsewhere the group falls back to a diagonal basis (each
channel quantized on its own, with the same water-filled step, mean and weights). A diagonal basis
is an ordinary .kvt basis (a scaled permutation), so the codec and every restore path code it
unchanged.

The comparison is at equal bytes. At each of a few target ratios' distortion levels theta the fitted
basis codes the held-out samples with the codec's own quantizer: a point (bits per token, weighted
squared error per token), bits the order-0 entropy of its integers per chunk of INT_CHUNK_TOKENS
(rate.column_entropy_bits). Per-channel int-N (the codec's min-max quantizer, kvcodec.quant.integer,
N = 1..8, parameters per chunk and channel) gives points the same way, its fp16 offset and step per
channel and chunk counted in its bits, and plain fp16 one more (16 bits per value). At each level the transform's error is paired with the
smallest int-N error of at most the transform's bits; the block keeps the basis only when its errors'
geometric mean over the levels is at most int's (keeps_transform, a pure function of those points):
every level counts by its relative error, so a near-lossless 3x level where int-7 is a little more
accurate does not throw away a basis ten times more accurate at 5x and 8x.
Both are charged the same order-0 measure: at most N bits per value for int-N, usually less.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvcodec.quant import integer
from kvcodec.transform import alloc, rate
from kvcodec.transform.calibration import GroupBasis

FALLBACK_RATIOS = (3.0, 5.0, 8.0)  # the ratios (vs fp16) whose distortion levels the comparison uses
INT_BITS = tuple(range(1, 9))  # the per-channel int widths compared against
INT_CHUNK_TOKENS = 256  # tokens per chunk, as the codecs cut KV (CodecConfig's default)
INT_SIDE_BITS = 32.0  # int-N's fp16 offset and step per channel and chunk

Point = tuple[float, float]  # (bits per token, weighted squared error per token)


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


def _chunked_bits(q: torch.Tensor, chunk: int) -> float:
    """Order-0 bits of integer columns q (tokens, coords), each chunk of `chunk` tokens its own models."""
    return sum(rate.column_entropy_bits(q[s : s + chunk]) for s in range(0, q.shape[0], chunk))


def transform_point(b: GroupBasis, y: torch.Tensor, theta: float, chunk: int = INT_CHUNK_TOKENS) -> Point:
    """(bits, weighted squared error) per token of the basis coding held-out coefficients y (n, d)
    at level theta with the codec's quantizer; coordinates without a step are not coded."""
    steps = alloc.steps_for(b.variances, theta).to(torch.float32)
    n = int((steps > 0).sum())
    q = torch.round(y[:, :n] / steps[:n])
    err = (y[:, :n] - q * steps[:n]).pow(2).sum() + y[:, n:].pow(2).sum()
    return _chunked_bits(q.to(torch.int64), chunk) / y.shape[0], float(err) / y.shape[0]


def int_point(x: torch.Tensor, w: torch.Tensor | None, bits: int, chunk: int = INT_CHUNK_TOKENS) -> Point:
    """(bits, weighted squared error) per token of per-channel min-max int-`bits` quantization of
    samples x (n, d), parameters per chunk of `chunk` tokens (kvcodec.quant.integer, the codec's)."""
    total_bits = err = 0.0
    width = torch.tensor([bits])
    for s in range(0, x.shape[0], chunk):
        xc = x[s : s + chunk].to(torch.float32)[None, None, :, None, :]  # (1, 1, tokens, 1, d)
        offset, step = integer.minmax_params(xc, width)
        q = integer.quantize(xc, offset, step, width)
        e = (integer.dequantize(q, offset, step, torch.float32) - xc).double().pow(2)[0, 0, :, 0]
        err += float(e.sum(0) @ (torch.ones(x.shape[1], dtype=torch.float64) if w is None else w.double()))
        centred = q[0, 0, :, 0].to(torch.int64) - (1 << (bits - 1))  # in [-128, 127]: no escapes
        total_bits += rate.column_entropy_bits(centred) + INT_SIDE_BITS * x.shape[1]
    return total_bits / x.shape[0], err / x.shape[0]


def keeps_transform(transform: Sequence[Point], per_channel: Sequence[Point]) -> bool:
    """True when the transform is at least as accurate for its size: at each transform point
    (bits, error) the per-channel error at equal or fewer bits (int_error_at) is paired with it, and
    the transform's errors' geometric mean is at most those. Levels where no per-channel point fits
    in the transform's bits have nothing of that size to compare with and are left out."""
    pairs = [(err, int_error_at(per_channel, bits)) for bits, err in transform]
    return sum(_log(e) - _log(i) for e, i in pairs if math.isfinite(i)) <= 0.0


def _log(err: float) -> float:
    return math.log(max(err, 1e-300))


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


def compare(fitted: GroupBasis, held_out: torch.Tensor, thetas: Sequence[float]) -> tuple[list[Point], list[Point]]:
    """The transform's points at levels thetas and per-channel int-N's (N in INT_BITS) and fp16's on
    held-out samples (n, d), errors weighted by the basis' channel weights."""
    y = coefficients(fitted, held_out)
    ints = [int_point(held_out, fitted.weights, n) for n in INT_BITS]
    return [transform_point(fitted, y, t) for t in thetas], [*ints, fp16_point(held_out, fitted.weights)]


def fp16_point(x: torch.Tensor, w: torch.Tensor | None) -> Point:
    """(bits, weighted squared error) per token of storing samples x (n, d) as fp16: the simplest
    per-channel code, so a transform spending more than 16 bits per value is compared with it."""
    e = (x.to(torch.float16).double() - x.double()).pow(2).sum(0)
    return 16.0 * x.shape[1], float(e @ (torch.ones_like(e) if w is None else w.double())) / x.shape[0]


def falls_back(fitted: GroupBasis, held_out: torch.Tensor, thetas: Sequence[float]) -> bool:
    """True when per-channel int-N is more accurate than the fitted basis at equal or fewer bytes
    at one of the levels thetas, on held-out samples (n, d)."""
    return not keeps_transform(*compare(fitted, held_out, thetas))


def int_error_at(per_channel: Sequence[Point], bits: float) -> float:
    """The smallest per-channel error spending at most `bits` per token (inf where none does)."""
    return min((e for b, e in per_channel if b <= bits), default=math.inf)
