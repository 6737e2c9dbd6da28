"""Coefficients <-> integers <-> 8-bit samples with an escape list.

Integers q = round(y / step) map to samples q + 128; the rare q outside [-128, 127] are clamped
in the samples and listed (flat index, true value) in an escape list, so the mapping is lossless.

A token may be coded with a finer step (step * token_scale, token_scale = 2^-bits for the
prefix's last tokens). A coefficient is restored at its bin's centre q * step ("centre") or, for
"laplace", at the centroid of the bin under a Laplacian of the coordinate's calibrated deviation:
q * step - sign(q) * delta * step, delta = recon_offset(step / sigma) (no side information).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvcodec.errors import CorruptStreamError

OFFSET = 128
RECONS = ("centre", "laplace")
MAX_FINE_BITS = 6


def token_scales(tokens: int, fine_tokens: int, fine_bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(tokens,) step multipliers: 1, and 2^-fine_bits for the last fine_tokens tokens."""
    scale = torch.ones(tokens, dtype=dtype)
    if fine_tokens > 0 and fine_bits > 0:
        scale[max(0, tokens - fine_tokens) :] = 2.0**-fine_bits
    return scale


def recon_offset(ratio: torch.Tensor) -> torch.Tensor:
    """delta in [0, 1/2): how far below |q| * step (in steps) the centroid of a bin q != 0 lies for a
    Laplacian of deviation sigma quantized with step = ratio * sigma. With r = step / b (b =
    sigma / sqrt 2 the Laplacian's scale) the density in a bin falls as exp(-u / b), whose mean
    over [0, step) is b - step / (e^r - 1): delta = 1/2 - 1/r + 1/(e^r - 1) (r / 12 for small r).
    ratio 0 (no deviation known, or padding) gives 0."""
    r = ratio * math.sqrt(2.0)
    safe = r.clamp_min(1e-2)
    exact = 0.5 - 1.0 / safe + 1.0 / torch.expm1(safe)
    return torch.where(r < 1e-2, r / 12.0, exact).clamp(0.0, 0.5)


def step_ratio(steps: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """step / sigma, the argument of recon_offset; 0 where no deviation is known."""
    return torch.where(sigmas > 0, steps / sigmas.clamp_min(1e-30), 0.0)


def quantize(y: torch.Tensor, steps: torch.Tensor, token_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Integers round(y / (steps * token_scale)) (int32); y (tokens, d), steps (d,) all > 0,
    token_scale (tokens,) (None: all 1)."""
    return rounded(scaled(y, steps, token_scale))


def scaled(y: torch.Tensor, steps: torch.Tensor, token_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y / (steps * token_scale), before rounding (a caller checks the range first)."""
    s = steps.to(y.dtype) if token_scale is None else steps.to(y.dtype) * token_scale.to(y.dtype)[:, None]
    return y / s


def rounded(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x).to(torch.int32)


def dequantize(
    q: torch.Tensor,
    steps: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    token_scale: torch.Tensor | None = None,
    sigmas: torch.Tensor | None = None,
    recon: str = "centre",
) -> torch.Tensor:
    """Coefficients (tokens, d) from integers q (tokens, d): each at its bin's reconstruction
    point for step steps[i] * token_scale[t] (recon "centre" or "laplace", the latter needs the
    coordinates' deviations `sigmas` (d,))."""
    s = steps.to(q.device, dtype)[None, :]
    if token_scale is not None:
        s = s * token_scale.to(q.device, dtype)[:, None]
    x = q.to(dtype)
    if recon == "laplace":
        x = x - torch.sign(x) * recon_offset(step_ratio(s, sigmas.to(q.device, dtype)[None, :]))
    elif recon != "centre":
        raise ValueError(f"reconstruction must be one of {RECONS}; got {recon!r}")
    return x * s


def to_samples(q: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """(uint8 samples of q's shape, escape flat indices int64, escape values int32)."""
    shifted = q.to(torch.int64) + OFFSET
    outside = (shifted < 0) | (shifted > 255)
    idx = torch.nonzero(outside.reshape(-1)).reshape(-1)
    values = q.reshape(-1)[idx].to(torch.int32)
    return shifted.clamp(0, 255).to(torch.uint8), idx.numpy().astype(np.int64), values.numpy()


def from_samples(samples: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The integers (int32, samples' shape and device) from samples and the escape list."""
    q = samples.to(torch.int32) - OFFSET
    if idx.numel():
        if int(idx.min()) < 0 or int(idx.max()) >= q.numel():
            raise CorruptStreamError("escape list names samples outside the chunk")
        flat = q.reshape(-1)
        flat[idx.to(q.device)] = values.to(q.device, torch.int32)
    return q


def pack_escapes(idx: np.ndarray, values: np.ndarray) -> bytes:
    """Escapes as bytes: count (uint32), delta-coded indices (uint32), values (int32)."""
    deltas = np.diff(idx, prepend=0).astype(np.uint32) if idx.size else np.zeros(0, np.uint32)
    return np.uint32(idx.size).tobytes() + deltas.tobytes() + values.astype(np.int32).tobytes()


def unpack_escapes(raw: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    if len(raw) < 4:
        raise CorruptStreamError("escape stream is truncated")
    n = int(np.frombuffer(raw[:4], np.uint32)[0])
    if len(raw) != 4 + 8 * n:
        raise CorruptStreamError(f"escape stream holds {len(raw)} bytes for {n} escapes")
    deltas = np.frombuffer(raw[4 : 4 + 4 * n], np.uint32).astype(np.int64)
    values = np.frombuffer(raw[4 + 4 * n :], np.int32).copy()
    return torch.from_numpy(np.cumsum(deltas)), torch.from_numpy(values)
