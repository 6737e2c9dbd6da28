"""Coefficients <-> integers <-> 8-bit samples with an escape list.

Integers q = round(y / step) map to samples q + 128; the rare q outside [-128, 127] are clamped
in the samples and listed (flat index, true value) in an escape list, so the mapping is lossless.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcodec.errors import CorruptStreamError

OFFSET = 128


def quantize(y: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Integers round(y / steps) (int32); y (..., d), steps (d,) all > 0."""
    return torch.round(y / steps.to(y.dtype)).to(torch.int32)


def dequantize(q: torch.Tensor, steps: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return q.to(dtype) * steps.to(dtype)


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
