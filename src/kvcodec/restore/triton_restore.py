"""The fused restorer: one Triton kernel per frame (CUDA, integer quant modes).

For every value of the frame's tokens (or of every frame of a chunk held in one buffer:
restore_frames) the kernel reads its sample from the frame (through the
plan's gather index and the frame's own strides, so NVDEC's pitched surface is read in place),
merges its low bits from the packed planes, uncenters, dequantizes and stores it at its place in
the output KV tensor. The reference restorer's ~10 launches and uint8/float temporaries of a
frame's size become one launch and no temporaries. A chunk whose samples were not coded as video
(zstd) is restored from its uploaded samples by the same kernel, reading them in place (restore_block).
"""

from __future__ import annotations

import functools
import os

import torch

from kvcodec.restore.paged import PagedChunk, PagedKV
from kvcodec.restore.terms import ChunkTerms

BLOCK = 1024
FORCE_WIDE = False  # True: the kernel's int64 index arithmetic whatever the launch's size (tests compare both)
MAX_LOW_BITS = 7  # video_bits >= 1 leaves at most 7 low bits of an 8-bit sample


@functools.cache
def triton_modules():  # noqa: ANN201 - (triton, triton.language), or None where Triton does not load
    """Triton and its language module, imported once (the fused restorer and the rANS decoder)."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # ImportError, or a broken toolchain
        return None
    return triton, tl


def interpreted() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET=1, read when a kernel is first made): the
    kernels run on CPU tensors, slowly; the tests check the kernels' source that way without a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    return triton_modules() is not None and torch.cuda.is_available()


def supports(terms: ChunkTerms) -> bool:
    return not terms.exact and terms.positions.is_cuda and available()


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    # integer arguments are not specialized on (value 1, multiple of 16): one compiled variant per
    # output dtype, instead of a compile whenever a chunk brings a new combination
    @triton.jit(
        do_not_specialize=[
            "plane_stride",
            "row_stride",
            "frame_w",
            "frame_hw",
            "frame_stride",
            "low_plane_bytes",
            "s_layer",
            "s_kv",
            "s_token",
            "s_head",
            "s_dim",
            "start",
            "n",
            "tpf",
            "units",
            "heads",
            "dim",
        ]
    )
    def restore_frame(
        frame_ptr,
        plane_stride,
        row_stride,
        frame_w,
        frame_hw,
        frame_stride,
        pos_ptr,
        low_ptr,
        low_plane_bytes,
        low_count_ptr,
        shift_ptr,
        mask_ptr,
        offset_ptr,
        step_ptr,
        out_ptr,
        s_layer,
        s_kv,
        s_token,
        s_head,
        s_dim,
        token_offset_ptr,
        start,
        n,
        tpf,
        units,
        heads,
        dim,
        PAGED: tl.constexpr,
        FLAT: tl.constexpr,
        WIDE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # the index arithmetic (a dozen divisions per value) in int32 unless the launch's values
        # reach 2^31 (WIDE): int64 division made the kernel compute-bound, ~40x slower than its
        # memory traffic on a 7-8B model's chunks; the addresses are formed in int64 either way
        if WIDE:
            idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        else:
            idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        total = units * n * dim
        live = idx < total
        d = idx % dim
        t = (idx // dim) % n
        u = idx // (dim * n)
        if FLAT:  # the samples themselves, (units, n, dim) contiguous: no frame to gather from
            src = frame_ptr + idx
        else:
            f = t // tpf  # the frame (of several, frame_stride apart) holding token t; 0 within one frame
            pos = tl.load(pos_ptr + (u * tpf + t - f * tpf) * dim + d, mask=live, other=0)
            pos = pos.to(tl.int64) if WIDE else pos.to(tl.int32)  # a place in one frame: < 3 * 8192^2
            plane = pos // frame_hw
            rem = pos - plane * frame_hw
            y = rem // frame_w
            x = rem - y * frame_w
            src = frame_ptr + f.to(tl.int64) * frame_stride + plane.to(tl.int64) * plane_stride + y * row_stride + x
        s = tl.load(src, mask=live, other=0).to(tl.int32)
        count = tl.load(low_count_ptr + u, mask=live, other=0).to(tl.int32)
        i = ((start + t).to(tl.int64) * units + u) * dim + d
        low = s * 0  # not tl.zeros_like (a jit function of the language): the interpreter (tests) refuses it
        for j in tl.static_range(7):  # MAX_LOW_BITS; loads past a unit's own count are masked off
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
        if PAGED:  # each token's place in its block, from the block table
            token = tl.load(token_offset_ptr + t, mask=live, other=0)
        else:
            token = (start + t).to(tl.int64) * s_token
        dst = layer.to(tl.int64) * s_layer + kv.to(tl.int64) * s_kv + token + head.to(tl.int64) * s_head + d * s_dim
        tl.store(out_ptr + dst, value.to(out_ptr.dtype.element_ty), mask=live)

    return restore_frame


class TritonRestorer:
    name = "triton"

    def __init__(self, terms: ChunkTerms):
        if terms.exact:
            raise ValueError("the fused restorer handles the integer quant modes; use TorchRestorer for exact")
        if not (terms.positions.is_cuda or interpreted()):
            raise ValueError("the fused restorer runs on CUDA tensors")
        if triton_modules() is None:
            raise RuntimeError("Triton is not installed")
        self.terms = terms
        self._offset = terms.offset.contiguous()
        self._step = terms.step.contiguous()
        self._shift = terms.shift.contiguous()
        self._mask = terms.mask.contiguous()
        self._low_counts = terms.low_counts.to(terms.positions.device, torch.int32).contiguous()
        planes = terms.low_planes
        self._low_planes = planes.contiguous() if planes is not None and planes.shape[0] else None

    def restore(self, frame: torch.Tensor, start: int, n: int, out) -> None:
        if n > self.terms.plan.tokens_per_frame:
            raise ValueError(f"a frame holds {self.terms.plan.tokens_per_frame} tokens, not {n}")
        self._launch(self._checked(frame), 0, start, n, out)

    def restore_frames(self, frames: torch.Tensor, n: int, out) -> None:
        """Tokens [0, n) of the chunk from its frames (F, 3, H, W), frame k holding the tokens
        from k * tokens_per_frame: one launch for every frame."""
        tpf = self.terms.plan.tokens_per_frame
        if frames.dim() != 4 or frames.shape[0] * tpf < n:
            raise ValueError(f"frames of shape {tuple(frames.shape)} do not hold {n} tokens")
        if frames.stride(3) != 1:
            frames = frames.contiguous()
        self._launch(self._checked(frames[0]), frames.stride(0), 0, n, out)

    def restore_block(self, block: torch.Tensor, start: int, n: int, out) -> None:
        """Tokens [start, start + n) from their centered samples `block` (units, n, dim) uint8 (a
        chunk's samples not coded as video), as TorchRestorer.restore_block: one launch."""
        t = self.terms
        if tuple(block.shape) != (t.units, n, t.head_dim) or block.dtype != torch.uint8:
            raise ValueError(
                f"samples of shape {tuple(block.shape)} {block.dtype} are not ({t.units}, {n}, {t.head_dim}) uint8"
            )
        self._launch(block.contiguous(), 0, start, n, out, flat=True)

    def _checked(self, frame: torch.Tensor) -> torch.Tensor:
        plan = self.terms.plan
        if frame.dim() != 3 or frame.shape[0] != 3 or frame.shape[1] < plan.height or frame.shape[2] < plan.width:
            raise ValueError(f"frame of shape {tuple(frame.shape)} does not hold {plan.width}x{plan.height} planes")
        return frame if frame.stride(2) == 1 else frame.contiguous()

    def _launch(self, frame: torch.Tensor, frame_stride: int, start: int, n: int, out, flat: bool = False) -> None:
        t = self.terms
        plan = t.plan
        low = self._low_planes
        if isinstance(out, PagedChunk):
            pages = out.paged.pages
            offsets = out.paged.token_offsets(out.first_token + start, n)
            base, strides, paged = pages, (pages.stride(0), pages.stride(1), 0, pages.stride(4), pages.stride(5)), True
        else:
            base, strides, paged, offsets = out, out.stride(), False, self._low_counts  # offsets unused
        total = t.units * n * t.head_dim
        grid = ((total + BLOCK - 1) // BLOCK,)
        _kernel()[grid](
            frame,
            frame.stride(0),
            frame.stride(1),
            plan.width,
            plan.width * plan.height,
            frame_stride,
            t.positions,
            low if low is not None else frame,
            low.shape[1] if low is not None else 0,
            self._low_counts,
            self._shift,
            self._mask,
            self._offset,
            self._step,
            base,
            *strides,
            offsets,
            start,
            n,
            plan.tokens_per_frame,
            t.units,
            t.kv_heads,
            t.head_dim,
            PAGED=paged,
            FLAT=flat,
            WIDE=FORCE_WIDE or total + BLOCK >= 2**31,
            BLOCK=BLOCK,
        )


def warm_up(device: torch.device | str, dtypes=(torch.float16, torch.bfloat16)) -> None:
    """Compile (or load from Triton's cache) the kernel for `dtypes` now, for frames and for zstd'd
    samples, into dense tensors and into paged caches (PagedKV: vLLM's blocks, PrefixCache.fetch's
    `out`), so that the first chunk a process restores does not wait for it (a pool worker calls
    this when it starts)."""
    from kvcodec.layout.tiling import LayoutPlan, gather_index

    device = torch.device(device)
    plan = LayoutPlan(144, 144, units=2, dim=8, tokens_per_frame=2, tile_w=8, tile_h=2)
    for dtype in dtypes:
        terms = ChunkTerms(
            plan=plan,
            layers=1,
            kv_heads=1,
            head_dim=8,
            tokens=2,
            dtype=dtype,
            positions=gather_index(plan, device),
            shift=torch.zeros((2, 1, 8), dtype=torch.uint8, device=device),
            mask=torch.full((2, 1, 1), 255, dtype=torch.uint8, device=device),
            low_counts=torch.ones(2, dtype=torch.int32, device=device),
            low_planes=torch.zeros((1, 4), dtype=torch.uint8, device=device),
            offset=torch.zeros((1, 2, 1, 8), dtype=torch.float16, device=device),
            step=torch.ones((1, 2, 1, 8), dtype=torch.float16, device=device),
        )
        frame = torch.zeros((3, 144, 144), dtype=torch.uint8, device=device)
        block = torch.zeros((2, 2, 8), dtype=torch.uint8, device=device)
        pages = torch.empty((1, 2, 1, 2, 1, 8), dtype=dtype, device=device)
        for out in (torch.empty((1, 2, 2, 1, 8), dtype=dtype, device=device), PagedChunk(PagedKV(pages, [0]), 0)):
            TritonRestorer(terms).restore(frame, 0, 2, out)
            TritonRestorer(terms).restore_block(block, 0, 2, out)
    torch.cuda.synchronize(device)
