"""The reference restorer: torch operations on any device, every quant mode."""

from __future__ import annotations

import torch

from kvcodec.layout.tiling import unpack_frame
from kvcodec.quant import bitsplit, centering
from kvcodec.quant import exact as exact_q
from kvcodec.quant import integer as int_q
from kvcodec.restore.paged import PagedChunk
from kvcodec.restore.terms import ChunkTerms


class TorchRestorer:
    name = "torch"

    def __init__(self, terms: ChunkTerms):
        self.terms = terms

    def samples(self, frame: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """The frame's centered-back integer samples of tokens [start, start + n), (units, n, dim)."""
        return self._uncentered(unpack_frame(frame, self.terms.plan, self.terms.positions)[:, :n], start, n)

    def restore(self, frame: torch.Tensor, start: int, n: int, out: torch.Tensor | PagedChunk) -> None:
        self.restore_block(unpack_frame(frame, self.terms.plan, self.terms.positions)[:, :n], start, n, out)

    def restore_block(self, block: torch.Tensor, start: int, n: int, out: torch.Tensor | PagedChunk) -> None:
        """Tokens [start, start + n) from their centered samples `block` (units, n, dim) uint8 (what a
        frame holds once unpacked, or a chunk's samples not coded as video) into `out`."""
        t = self.terms
        block = self._uncentered(block, start, n).view(t.layers, 2, t.kv_heads, n, t.head_dim).permute(0, 1, 3, 2, 4)
        if t.exact:
            values = exact_q.join_bytes([block, *(p[:, :, start : start + n] for p in t.byte_planes)], t.dtype)
        else:
            values = int_q.dequantize(block, t.offset, t.step, t.dtype)
        if isinstance(out, PagedChunk):
            blocks, within = out.paged.slots(out.first_token + start, n)
            out.paged.pages[:, :, blocks, within] = values
        else:
            out[:, :, start : start + n].copy_(values)

    def _uncentered(self, block: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """`block`'s low bit planes merged back and its centring undone."""
        t = self.terms
        if t.low_planes is not None:
            low = bitsplit.unpack_low(
                bitsplit.plane_slice(t.low_planes, start, n, t.units, t.head_dim), t.units, t.head_dim
            )
            block = bitsplit.join(block, low, t.low_counts)
        return centering.uncenter_with(block, t.shift, t.mask)
