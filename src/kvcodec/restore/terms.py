"""What restoring a chunk needs, on the output device, and the restorer protocol."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from kvcodec.layout.tiling import LayoutPlan


@dataclasses.dataclass(frozen=True)
class ChunkTerms:
    """Per-chunk restore terms, all on the output's device.

    positions: int32 gather index of the plan (value -> flattened (3, H, W) frame position).
    shift, mask: uncentering terms, (units, 1, dim) and (units, 1, 1) uint8.
    low_counts: (units,) int32 low bits per unit kept out of the video (all zero: none).
    low_planes: (planes, tokens * units * dim / 8) uint8 packed low bits, or None.
    offset, step: (layers, 2, heads, dim) dequantization parameters (integer modes), else None.
    byte_planes: exact mode's remaining byte planes, each (layers, 2, tokens, heads, dim) uint8.
    samples: the centered samples (units, tokens, dim) uint8 of a chunk not coded as video (its
        zstd-coded samples, uploaded with the side streams), else None.
    """

    plan: LayoutPlan
    layers: int
    kv_heads: int
    head_dim: int
    tokens: int
    dtype: torch.dtype
    positions: torch.Tensor
    shift: torch.Tensor
    mask: torch.Tensor
    low_counts: torch.Tensor
    low_planes: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    step: torch.Tensor | None = None
    byte_planes: tuple[torch.Tensor, ...] = ()
    samples: torch.Tensor | None = None

    @property
    def exact(self) -> bool:
        return self.offset is None

    @property
    def units(self) -> int:
        return self.layers * 2 * self.kv_heads


class FrameRestorer(Protocol):
    name: str

    def restore(self, frame: torch.Tensor, start: int, n: int, out) -> None:
        """Write tokens [start, start + n) of the chunk, held by `frame` ((3, H, W) uint8, any
        strides), into `out`: the chunk's (layers, 2, tokens, heads, dim) output tensor, or a
        kvcodec.restore.paged.PagedChunk (blocks of a paged cache)."""
        ...
