"""The transform's inverse around cuBLAS's GEMM as two Triton kernels (CUDA; the float16 GEMM's
conditions): the gather before it and the epilogue after it.

transform_kernels.restore runs the batched inverse transform as select, cast and centre, the
float16 GEMM (cuBLAS, tensor cores), then about eight float32 passes over every value (steps,
means, row order, RoPE's partner gather, multiply and add, permute + cast): more than the GEMM's
own time on a 7-8B model's chunks. Here gather_centred makes the GEMM's q operand from the
chunks' uint8 samples in one pass (reading each chunk where it lies: meta_table), and the epilogue
does the rest in one more, a chunk's exact sink tokens included: each program takes
one (layer, kind, head) of the batch, all its channels over a tile of token columns; it reads the
GEMM's rows of those channels (consecutive rows: unit_table) and, for keys, of their RoPE partners,
applies the blocks' scales, the token scales, the means and the rotation in registers, and stores
the cast values straight into the chunks' outputs (a table of their addresses), whole heads per
token, so the writes are contiguous along the channels. The GEMM stays with cuBLAS: a Triton GEMM
over gathered basis rows measured twice as slow. Few kernels matter beside a busy GPU more than idle:
each waits for the SMs on its own (a traced fetch beside a looping bf16 matmul: 1-2 ms per kernel).
The reference kernels (restore + emit) are the fallback and the tests' reference.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import numpy as np
import torch

from kvcodec.restore.triton_restore import triton_modules

log = logging.getLogger(__name__)

FUSED = True  # False after a failed compile or launch: the reference kernels restore instead
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the kernel's OUT code is the index
BLOCK_N = 32  # token columns per program of the epilogue (all of a head's channels in each)
GATHER_SLOTS, GATHER_COLS = 16, 128


def unit_table(rows: np.ndarray, shape: tuple[int, int, int], rope_pairs) -> tuple[np.ndarray, np.ndarray]:
    """The epilogue's index tables: (L * 2 * H,) int64 GEMM row (j * d + r) of channel 0 of every
    (layer, kind, head), whose channels follow it row by row, and (2, D) int32: each channel's RoPE
    partner (itself where it does not rotate) and whether it rotates (keys only). rows[i]: the GEMM
    row of output element i in (layer, kind, head, channel) order (BatchedPlan.rows); rope_pairs:
    (partner, rotates) per head channel, or None. Pure index arithmetic."""
    L, H, D = shape
    heads = rows.reshape(L * 2 * H, D)
    if np.any(heads != heads[:, :1] + np.arange(D)):
        raise ValueError("a head's channels are not consecutive rows of the GEMM's output")
    partner, rotating = (np.arange(D), np.zeros(D, dtype=bool)) if rope_pairs is None else rope_pairs
    partner = np.where(rotating, partner, np.arange(D))
    return heads[:, 0].astype(np.int64), np.stack([partner, rotating]).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Launch:
    """What one epilogue needs beside the plan: the GEMM's products and where they go."""

    x: torch.Tensor  # (J, d, N t) float32 basis products of the centred integers (before steps and means)
    cos: torch.Tensor  # (D, T) float32 (or a 1 x 1 dummy without RoPE)
    sin: torch.Tensor
    token_scales: torch.Tensor | None  # (N, t) float32 step multipliers
    meta: torch.Tensor  # (5 N,) int64 on the device: meta_table
    tokens: int
    out_strides: tuple[int, ...]  # of every output (L, 2, t, H, D), in elements
    heads: int  # H of the outputs (L, 2, t, H, D)
    out_dtype: torch.dtype
    sinks: bool = False  # some chunk has sink tokens (meta_table) to write over its first ones


def meta_table(starts, outs, samples, sinks) -> torch.Tensor:  # noqa: ANN001
    """The kernels' per-chunk table of N chunks, (5 N,) int64 on the host: first positions, output
    addresses, sample addresses ((C, t) uint8 each), sink addresses ((L, 2, s, H, D) float16 each,
    0: none) and sink lengths s. One upload gives both kernels every chunk: no stacked copy of the
    samples, no sink copy after the epilogue."""
    ptrs = [0 if s is None else s.data_ptr() for s in sinks]
    lens = [0 if s is None else s.shape[2] for s in sinks]
    rows = [list(starts), [o.data_ptr() for o in outs], [c.data_ptr() for c in samples], ptrs, lens]
    return torch.tensor([v for row in rows for v in row], dtype=torch.int64)


def supports(outs, shape: tuple[int, int, int], tokens: int, device: torch.device) -> bool:
    """Triton loads, the device is CUDA and the outputs are (L, 2, t, H, D) tensors of one float
    dtype there, with one set of strides (e.g. slices of one prefix's KV)."""
    if not FUSED or device.type != "cuda" or triton_modules() is None:
        return False
    L, H, D = shape
    want = (L, 2, tokens, H, D)
    dtype, strides = outs[0].dtype, outs[0].stride()
    return dtype in OUT_DTYPES and all(
        o.device == device and o.dtype == dtype and tuple(o.shape) == want and o.stride() == strides for o in outs
    )


def launch(plan, run: Launch) -> bool:
    """Run the kernel; False (and the fused path off for this process) where it fails to compile
    or launch, so the caller restores by the reference path."""
    global FUSED
    try:
        _launch(plan, run)
        return True
    except Exception as e:  # noqa: BLE001 - a broken toolchain or an unsupported GPU: fall back, once
        FUSED = False
        log.warning(
            "fused inverse transform unavailable (%s: %s): restoring with the reference kernels", type(e).__name__, e
        )
        return False


def _launch(plan, run: Launch) -> None:
    _, d, NT = run.x.shape
    N, D = NT // run.tokens, plan.channels.shape[1]
    ts = run.token_scales.reshape(-1) if run.token_scales is not None else run.cos
    s_l, s_kind, s_tok, s_head, s_ch = run.out_strides
    grid = (plan.units.numel(), _cdiv(NT, BLOCK_N))
    with torch.cuda.device(run.x.device):  # Triton launches on the current device's current stream
        _kernel()[grid](
            run.x, plan.scales, plan.centred_means, plan.units, plan.channels, run.cos, run.sin, ts, run.meta,
            d, NT, run.tokens, run.cos.shape[1], s_l, s_kind, s_tok, s_head, s_ch, N, run.heads, D,
            HAS_TS=run.token_scales is not None, HAS_SINK=run.sinks, OUT=OUT_DTYPES.index(run.out_dtype),
            BLOCK_D=_next_pow2(D), BLOCK_N=BLOCK_N, num_warps=4,
        )  # fmt: skip


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def gather_centred(table: torch.Tensor, gather: torch.Tensor, t: int, N: int) -> torch.Tensor | None:
    """(slots, N t) float16 q of N chunks' samples, (C, t) uint8 each at the addresses `table`
    ((N,) int64 on the device) holds: each block slot's coded coordinate (gather[slot]: its row
    among the C), centred (sample - 128); one pass instead of stack, select, cast and centre.
    None where the kernel fails (the fused path is then off for this process)."""
    global FUSED
    slots = gather.numel()
    out = torch.empty((slots, N * t), dtype=torch.float16, device=table.device)
    grid = (_cdiv(slots, GATHER_SLOTS), _cdiv(N * t, GATHER_COLS))
    try:
        with torch.cuda.device(table.device):
            _gather_kernel()[grid](
                table, gather, out, t, N * t, slots, SLOTS=GATHER_SLOTS, COLS=GATHER_COLS, num_warps=4
            )
    except Exception as e:  # noqa: BLE001 - a broken toolchain or an unsupported GPU: fall back, once
        FUSED = False
        log.warning("fused gather unavailable (%s: %s): restoring with the reference kernels", type(e).__name__, e)
        return None
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    # s_ch is left to specialize: at 1 (dense heads) the stores are provably contiguous along the
    # channels, so each warp writes whole rows of a token's head
    @triton.jit(do_not_specialize=["d", "NT", "t", "table_len", "s_l", "s_kind", "s_tok", "s_head", "N", "H"])
    def inverse_epilogue(
        x_ptr, scales_ptr, means_ptr, units_ptr, channels_ptr, cos_ptr, sin_ptr, ts_ptr, meta_ptr,
        d, NT, t, table_len, s_l, s_kind, s_tok, s_head, s_ch, N, H, D,
        HAS_TS: tl.constexpr, HAS_SINK: tl.constexpr, OUT: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        u = tl.program_id(0)
        row0 = tl.load(units_ptr + u)
        c = tl.arange(0, BLOCK_D)
        c_ok = c < D
        partner = tl.load(channels_ptr + c, mask=c_ok, other=0).to(tl.int64)
        is_key = (u // H) % 2 == 0
        turn = (tl.load(channels_ptr + D + c, mask=c_ok, other=0) != 0) & is_key
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols < NT
        keep = c_ok[:, None] & n_ok[None, :]
        rotate = keep & turn[:, None]
        scale = tl.load(scales_ptr + row0 // d)
        own = row0 + c
        other = row0 + partner
        x = tl.load(x_ptr + own[:, None] * NT + cols[None, :], mask=keep, other=0.0) * scale
        xp = tl.load(x_ptr + other[:, None] * NT + cols[None, :], mask=rotate, other=0.0) * scale
        if HAS_TS:
            ts = tl.load(ts_ptr + cols, mask=n_ok, other=1.0)
            x = x * ts[None, :]
            xp = xp * ts[None, :]
        x = x + tl.load(means_ptr + own, mask=c_ok, other=0.0)[:, None]
        xp = xp + tl.load(means_ptr + other, mask=c_ok, other=0.0)[:, None]
        chunk = cols // t
        tok = cols - chunk * t
        pos = tl.load(meta_ptr + chunk, mask=n_ok, other=0) + tok
        at = c.to(tl.int64)[:, None] * table_len + pos[None, :]
        cos = tl.load(cos_ptr + at, mask=rotate, other=1.0)
        sin = tl.load(sin_ptr + at, mask=rotate, other=0.0)
        y = xp * sin + x * cos  # as the reference: partner * signed sin + own * cos
        if HAS_SINK:  # a chunk's first tokens kept exact: its sink's values, not the restored ones
            sink_len = tl.load(meta_ptr + 4 * N + chunk, mask=n_ok, other=0)
            in_sink = n_ok & (tok < sink_len)
            sink = tl.load(meta_ptr + 3 * N + chunk, mask=in_sink, other=0).to(tl.pointer_type(tl.float16))
            lk = (u // H).to(tl.int64)  # layer * 2 + kind
            at_sink = ((lk * sink_len + tok) * H + u % H) * D
            exact = tl.load(sink[None, :] + at_sink[None, :] + c[:, None], mask=c_ok[:, None] & in_sink[None, :])
            y = tl.where(in_sink[None, :], exact.to(tl.float32), y)
        addr = tl.load(meta_ptr + N + chunk, mask=n_ok, other=0)
        if OUT == 0:
            out = addr.to(tl.pointer_type(tl.float16))
        elif OUT == 1:
            out = addr.to(tl.pointer_type(tl.bfloat16))
        else:
            out = addr.to(tl.pointer_type(tl.float32))
        unit = (u // (2 * H)).to(tl.int64) * s_l + ((u // H) % 2).to(tl.int64) * s_kind + (u % H).to(tl.int64) * s_head
        col_off = tok.to(tl.int64) * s_tok
        tl.store(out[None, :] + (unit + c * s_ch)[:, None] + col_off[None, :], y, mask=keep)

    return inverse_epilogue


@functools.cache
def _gather_kernel():
    triton, tl = triton_modules()

    @triton.jit(do_not_specialize=["t", "NT", "slots"])
    def gather_centred(table_ptr, gather_ptr, out_ptr, t, NT, slots, SLOTS: tl.constexpr, COLS: tl.constexpr):
        slot = tl.program_id(0) * SLOTS + tl.arange(0, SLOTS)
        s_ok = slot < slots
        row = tl.load(gather_ptr + slot, mask=s_ok, other=0)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        c_ok = cols < NT
        chunk = cols // t
        tok = cols - chunk * t
        keep = s_ok[:, None] & c_ok[None, :]
        base = tl.load(table_ptr + chunk, mask=c_ok, other=0).to(tl.pointer_type(tl.uint8))
        src = base[None, :] + tok[None, :] + (row * t)[:, None]
        q = (tl.load(src, mask=keep, other=128).to(tl.float32) - 128.0).to(tl.float16)
        tl.store(out_ptr + slot.to(tl.int64)[:, None] * NT + cols[None, :], q, mask=keep)

    return gather_centred
