"""High/low bit split of the 8-bit samples (pure functions).

On real KV the low bits of each quantized value are close to uniform noise: no coder shrinks them,
and lossless HEVC codes them at more than one bit per bit (benchmarks/results/ratio-*.md). So each
sample of a unit with `bits` significant bits is split into its top `video_bits` bits, which go
through the video stream (NVDEC decodes them), and its `bits - video_bits` low bits, which are
stored as packed bit planes and merged back on the decoding device with a few integer operations.

Low bit planes are laid out token-major: value i of a chunk is (token, unit, channel) flattened, so
the values of a run of tokens are a contiguous byte range of every plane (a frame's low bits are a
slice). Plane j holds bit j of every value, eight values per byte, least significant bit first.
"""

from __future__ import annotations

import numpy as np
import torch

FULL = 8  # video_bits meaning "no split": every bit of the sample goes through the video stream


def low_bit_counts(unit_bits: torch.Tensor, video_bits: int) -> torch.Tensor:
    """Per unit, how many low bits are kept out of the video: max(bits - video_bits, 0).
    unit_bits: (units,) int64 significant bits of each unit's samples."""
    return (unit_bits.to(torch.int64) - int(video_bits)).clamp_(min=0)


def split(samples: torch.Tensor, low_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """samples (units, tokens, dim) uint8 -> (high, low), both uint8 of that shape, with
    samples == (high << low_count) | low per unit."""
    shift = low_counts.to(samples.device, torch.uint8).view(-1, 1, 1)
    high = samples >> shift
    low = samples - (high << shift)
    return high, low


def join(high: torch.Tensor, low: torch.Tensor, low_counts: torch.Tensor) -> torch.Tensor:
    """Inverse of split (uint8 only)."""
    shift = low_counts.to(high.device, torch.uint8).view(-1, 1, 1)
    return (high << shift).bitwise_or_(low)


def plane_count(low_counts: torch.Tensor) -> int:
    return int(low_counts.max()) if low_counts.numel() else 0


def can_split(units: int, dim: int) -> bool:
    """Whether one token's low bits fill whole bytes of a plane (what per-frame slicing needs)."""
    return (units * dim) % 8 == 0


def pack_low(low: torch.Tensor, low_counts: torch.Tensor) -> torch.Tensor:
    """low (units, tokens, dim) uint8 -> bit planes (planes, tokens * units * dim / 8) uint8.
    Bits a unit does not have (j >= its low count) are zero, which a byte coder removes."""
    units, tokens, dim = low.shape
    if not can_split(units, dim):
        raise ValueError(f"{units} units x {dim} channels per token do not fill whole bytes")
    planes = plane_count(low_counts)
    flat = low.permute(1, 0, 2).reshape(-1)
    if flat.device.type == "cpu" and planes:  # numpy's packbits: one uint8 pass per plane
        values = flat.numpy()
        return torch.from_numpy(np.stack([np.packbits((values >> j) & 1, bitorder="little") for j in range(planes)]))
    return pack_planes_torch(flat, planes)


def pack_planes_torch(flat: torch.Tensor, planes: int) -> torch.Tensor:
    """pack_low's planes from its flat token-major uint8 values, on any device (uint8 only)."""
    weights = (1 << torch.arange(8, dtype=torch.int32, device=flat.device)).to(torch.uint8)
    out = torch.empty((planes, flat.numel() // 8), dtype=torch.uint8, device=flat.device)
    bits = flat.view(-1, 8)
    for j in range(planes):
        out[j] = (((bits >> j) & 1) * weights).sum(1, dtype=torch.uint8)
    return out


def unpack_low(planes: torch.Tensor, units: int, dim: int) -> torch.Tensor:
    """Bit planes (planes, n_tokens * units * dim / 8) uint8 -> low (units, n_tokens, dim) uint8.
    Works on a slice of whole tokens of the planes, on any device, without wide temporaries."""
    count, nbytes = planes.shape
    tokens = nbytes * 8 // (units * dim)
    low = torch.zeros((tokens, units, dim), dtype=torch.uint8, device=planes.device)
    if count == 0:
        return low.permute(1, 0, 2)
    bit_index = torch.arange(8, dtype=torch.uint8, device=planes.device)
    flat = low.view(-1, 8)
    for j in range(count):
        bits = (planes[j].unsqueeze(1) >> bit_index) & 1
        flat |= bits << j
    return low.permute(1, 0, 2)


def plane_slice(planes: torch.Tensor, first_token: int, tokens: int, units: int, dim: int) -> torch.Tensor:
    """The bytes of `planes` that hold tokens [first_token, first_token + tokens)."""
    per_token = units * dim // 8
    return planes[:, first_token * per_token : (first_token + tokens) * per_token]
