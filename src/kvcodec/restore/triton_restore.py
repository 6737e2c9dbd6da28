"""The fused restorer: one Triton kernel per frame (CUDA, integer quant modes).

For every value of the frame's tokens the kernel reads its sample from the frame (through the
plan's gather index and the frame's own strides, so NVDEC's pitched surface is read in place),
merges its low bits from the packed planes, uncenters, dequantizes and stores it at its place in
the output KV tensor. The reference restorer's ~10 launches and uint8/float temporaries of a
frame's size become one launch and no temporaries.
"""

from __future__ import annotations

import functools

import torch

from kvcodec.restore.terms import ChunkTerms

BLOCK = 1024


@functools.cache
def _triton():
    try:
        import triton
        import triton.language as tl
    except Exception:  # ImportError, or a broken toolchain
        return None
    return triton, tl


def available() -> bool:
    return _triton() is not None and torch.cuda.is_available()


def supports(terms: ChunkTerms) -> bool:
    return not terms.exact and terms.positions.is_cuda and available()


@functools.cache
def _kernel():
    triton, tl = _triton()

    @triton.jit
    def restore_frame(
        frame_ptr, plane_stride, row_stride, frame_w, frame_hw,
        pos_ptr, low_ptr, low_plane_bytes, low_count_ptr,
        shift_ptr, mask_ptr, offset_ptr, step_ptr,
        out_ptr, s_layer, s_kv, s_token, s_head, s_dim,
        start, n, tpf, units, heads, dim,
        LOW_PLANES: tl.constexpr, BLOCK: tl.constexpr,
    ):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        total = units * n * dim
        live = idx < total
        d = idx % dim
        t = (idx // dim) % n
        u = idx // (dim * n)
        pos = tl.load(pos_ptr + (u * tpf + t) * dim + d, mask=live, other=0).to(tl.int64)
        plane = pos // frame_hw
        rem = pos - plane * frame_hw
        y = rem // frame_w
        x = rem - y * frame_w
        s = tl.load(frame_ptr + plane * plane_stride + y * row_stride + x, mask=live, other=0).to(tl.int32)
        if LOW_PLANES > 0:
            count = tl.load(low_count_ptr + u, mask=live, other=0).to(tl.int32)
            i = ((start + t) * units + u) * dim + d
            low = tl.zeros_like(s)
            for j in tl.static_range(LOW_PLANES):
                byte = tl.load(low_ptr + j * low_plane_bytes + (i >> 3), mask=live & (j < count), other=0).to(tl.int32)
                low = low | (((byte >> (i & 7).to(tl.int32)) & 1) << j)
            s = (s << count) | low
        ch = u * dim + d
        shift = tl.load(shift_ptr + ch, mask=live, other=0).to(tl.int32)
        mask = tl.load(mask_ptr + u, mask=live, other=0).to(tl.int32)
        s = (s + shift) & mask
        offset = tl.load(offset_ptr + ch, mask=live, other=0).to(tl.float32)
        step = tl.load(step_ptr + ch, mask=live, other=0).to(tl.float32)
        value = tl.fma(s.to(tl.float32), step, offset)  # one rounding, as quant.integer.dequantize
        layer = u // (2 * heads)
        kv = (u // heads) % 2
        head = u % heads
        dst = layer * s_layer + kv * s_kv + (start + t) * s_token + head * s_head + d * s_dim
        tl.store(out_ptr + dst, value.to(out_ptr.dtype.element_ty), mask=live)

    return restore_frame


class TritonRestorer:
    name = "triton"

    def __init__(self, terms: ChunkTerms):
        if terms.exact:
            raise ValueError("the fused restorer handles the integer quant modes; use TorchRestorer for exact")
        if not terms.positions.is_cuda:
            raise ValueError("the fused restorer runs on CUDA tensors")
        if _triton() is None:
            raise RuntimeError("Triton is not installed")
        self.terms = terms
        self._offset = terms.offset.contiguous()
        self._step = terms.step.contiguous()
        self._shift = terms.shift.contiguous()
        self._mask = terms.mask.contiguous()
        self._low_counts = terms.low_counts.to(terms.positions.device, torch.int32).contiguous()
        planes = terms.low_planes
        self._low_planes = planes.contiguous() if planes is not None and planes.shape[0] else None

    def restore(self, frame: torch.Tensor, start: int, n: int, out: torch.Tensor) -> None:
        t = self.terms
        plan = t.plan
        if frame.dim() != 3 or frame.shape[0] != 3 or frame.shape[1] < plan.height or frame.shape[2] < plan.width:
            raise ValueError(f"frame of shape {tuple(frame.shape)} does not hold {plan.width}x{plan.height} planes")
        if frame.stride(2) != 1:
            frame = frame.contiguous()
        low = self._low_planes
        total = t.units * n * t.head_dim
        grid = ((total + BLOCK - 1) // BLOCK,)
        _kernel()[grid](
            frame, frame.stride(0), frame.stride(1), plan.width, plan.width * plan.height,
            t.positions, low if low is not None else frame, low.shape[1] if low is not None else 0, self._low_counts,
            self._shift, self._mask, self._offset, self._step,
            out, *out.stride(),
            start, n, plan.tokens_per_frame, t.units, t.kv_heads, t.head_dim,
            LOW_PLANES=low.shape[0] if low is not None else 0, BLOCK=BLOCK,
        )
