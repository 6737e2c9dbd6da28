"""Codec-friendly frame layout (pure functions).

A chunk of KV integers, viewed as `units x tokens x dim` (a unit is one (layer, K/V, head)), is cut
along the token axis into groups of `tokens_per_frame` consecutive tokens: group f becomes frame f,
so neighbouring tokens sit in neighbouring frames (inter prediction) and inside a tile (intra
prediction). Inside a frame, each unit owns one rectangular tile of `tile_h x tile_w` samples on
one of the three 4:4:4 planes: a tile never holds two heads. A tile holds its unit's
`tokens_per_frame x dim` block either token-major (rows run along channels) or channel-major
(rows run along tokens), reshaped row-major to the tile's width.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np
import torch

from kvcodec.errors import ConfigError

PLANES = 3
ORIENTATIONS = ("token_major", "channel_major")


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    width: int
    height: int
    units: int  # layers * 2 * kv_heads
    dim: int  # head_dim
    tokens_per_frame: int
    tile_w: int
    tile_h: int
    orientation: str = "token_major"

    def __post_init__(self) -> None:
        if self.orientation not in ORIENTATIONS:
            raise ConfigError(f"unknown tile orientation {self.orientation!r}")
        if self.tile_w * self.tile_h != self.tokens_per_frame * self.dim:
            raise ConfigError(
                f"tile {self.tile_w}x{self.tile_h} cannot hold {self.tokens_per_frame} x {self.dim} values"
            )
        if self.capacity < self.units:
            raise ConfigError(f"a {self.width}x{self.height} frame holds {self.capacity} tiles, needs {self.units}")

    @property
    def tiles_x(self) -> int:
        return self.width // self.tile_w

    @property
    def tiles_y(self) -> int:
        return self.height // self.tile_h

    @property
    def capacity(self) -> int:
        return PLANES * self.tiles_x * self.tiles_y

    def frames_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.tokens_per_frame)

    @property
    def fill(self) -> float:
        """Fraction of a frame's samples that carry KV values."""
        return self.units * self.tokens_per_frame * self.dim / (PLANES * self.width * self.height)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayoutPlan:
        return cls(**d)


def candidate_plans(width: int, height: int, units: int, dim: int, max_tokens: int) -> list[LayoutPlan]:
    """Every tile shape that keeps channels aligned (tile width a divisor or multiple of the row
    length), with, for each, the most tokens per frame that fit (at most max_tokens)."""
    plans: list[LayoutPlan] = []
    for orientation in ORIENTATIONS:
        for tile_w in _tile_widths(width, dim):
            tpf = _max_tokens_per_frame(width, height, units, dim, tile_w, orientation, max_tokens)
            if tpf:
                plans.append(LayoutPlan(width, height, units, dim, tpf, tile_w, tpf * dim // tile_w, orientation))
    if not plans:
        raise ConfigError(f"no tile layout fits {units} tiles of head_dim {dim} into {width}x{height} frames")
    return sorted(set(plans), key=lambda p: (-p.tokens_per_frame, p.orientation, p.tile_w))


def _tile_widths(width: int, dim: int) -> list[int]:
    out = set()
    for k in (1, 2, 4, 8):
        if dim % k == 0 and dim // k >= 8:
            out.add(dim // k)
        out.add(dim * k)
    return sorted(w for w in out if w <= width)


def _max_tokens_per_frame(width, height, units, dim, tile_w, orientation, max_tokens) -> int:
    most = min(max_tokens, height * tile_w // dim)  # more tokens make a tile taller than the frame
    for tpf in range(most, 0, -1):
        n = tpf * dim
        if n % tile_w:
            continue
        if orientation == "channel_major" and not (tile_w % tpf == 0 or tpf % tile_w == 0):
            continue  # rows must hold whole per-channel token runs
        tile_h = n // tile_w
        if tile_h > height:
            continue
        if PLANES * (width // tile_w) * (height // tile_h) >= units:
            return tpf
    return 0


@functools.lru_cache(maxsize=64)
def _pixel_positions_cached(plan: LayoutPlan) -> torch.Tensor:
    u = torch.arange(plan.units).view(-1, 1, 1)
    t = torch.arange(plan.tokens_per_frame).view(1, -1, 1)
    c = torch.arange(plan.dim).view(1, 1, -1)
    # position of each value inside its tile, row-major
    if plan.orientation == "token_major":
        inner = t * plan.dim + c
    else:
        inner = c * plan.tokens_per_frame + t
    row, col = inner // plan.tile_w, inner % plan.tile_w
    per_plane = plan.tiles_x * plan.tiles_y
    plane = u // per_plane
    ty = (u % per_plane) // plan.tiles_x
    tx = u % plan.tiles_x
    y = ty * plan.tile_h + row
    x = tx * plan.tile_w + col
    return ((plane * plan.height + y) * plan.width + x).reshape(-1)


def pixel_positions(plan: LayoutPlan, device: torch.device | str = "cpu") -> torch.Tensor:
    """For each value of a frame's block (units x tokens_per_frame x dim, row-major), its position in
    the flattened (3, height, width) frame. Distinct positions, so packing is a scatter and
    unpacking a gather."""
    return _pixel_positions_cached(plan).to(device)


@functools.lru_cache(maxsize=64)
def _gather_index(plan: LayoutPlan, device: str) -> torch.Tensor:
    return _pixel_positions_cached(plan).to(device=device, dtype=torch.int32)


def gather_index(plan: LayoutPlan, device: torch.device | str) -> torch.Tensor:
    """pixel_positions as int32, kept on `device` for the process: the restore path gathers with
    it once per frame, and building or copying it per chunk costs more than the gather."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _gather_index(plan, str(device))


@functools.lru_cache(maxsize=16)
def _inverse_positions(plan: LayoutPlan) -> np.ndarray:
    """For each sample of the flattened frame, the index of the block value it holds, or the
    block's size (a fill sample): packing becomes one gather."""
    size = plan.units * plan.tokens_per_frame * plan.dim
    inverse = np.full(PLANES * plan.height * plan.width, size, dtype=np.int32)
    inverse[_pixel_positions_cached(plan).numpy()] = np.arange(size, dtype=np.int32)
    return inverse


def pack_frame(block: torch.Tensor, plan: LayoutPlan, fill_value: int = 0) -> torch.Tensor:
    """block: (units, tokens_per_frame, dim) uint8 -> frame (3, height, width) uint8."""
    if block.device.type == "cpu":  # a gather through the inverse positions: several times faster
        src = np.empty(block.numel() + 1, dtype=np.uint8)
        src[:-1] = block.reshape(-1).numpy()
        src[-1] = fill_value
        return torch.from_numpy(np.take(src, _inverse_positions(plan))).view(PLANES, plan.height, plan.width)
    frame = torch.full((PLANES * plan.height * plan.width,), fill_value, dtype=torch.uint8, device=block.device)
    frame[pixel_positions(plan, block.device)] = block.reshape(-1)
    return frame.view(PLANES, plan.height, plan.width)


def unpack_frame(frame: torch.Tensor, plan: LayoutPlan, positions: torch.Tensor | None = None) -> torch.Tensor:
    """frame (3, height, width) uint8 -> block (units, tokens_per_frame, dim) uint8."""
    pos = positions if positions is not None else gather_index(plan, frame.device)
    return torch.index_select(frame.reshape(-1), 0, pos).view(plan.units, plan.tokens_per_frame, plan.dim)


PAD_SAMPLE = 0  # what the last frame's missing tokens hold (decoders read only the real ones)


def frame_blocks(units_tokens_dim: torch.Tensor, plan: LayoutPlan):
    """Yield (first_token, n_tokens, block) per frame; the last block's missing tokens are
    PAD_SAMPLE. A constant costs x265 next to nothing: repeating the final token instead (the
    earlier padding) made a 30-layer SmolLM2 frame of 16 real tokens in 64 cost as much encode
    time as a full one and 3.9x its bytes (kvcodec bench encode)."""
    total = units_tokens_dim.shape[1]
    for start in range(0, total, plan.tokens_per_frame):
        block = units_tokens_dim[:, start : start + plan.tokens_per_frame]
        n = block.shape[1]
        if n < plan.tokens_per_frame:
            padded = block.new_full((block.shape[0], plan.tokens_per_frame, block.shape[2]), PAD_SAMPLE)
            padded[:, :n] = block
            block = padded
        yield start, n, block
