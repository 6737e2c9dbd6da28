"""The fused epilogue of the inverse transform: one Triton kernel from the GEMM's products of N
chunks to their scaled, rotated, cast values in each chunk's output (CUDA; the split GEMM's
conditions).

transform_kernels.restore runs the batched inverse transform as the float16 [hi | lo] GEMM (cuBLAS,
tensor cores) and then about eight float32 passes over every value (steps, means, row order, RoPE's
partner gather, multiply and add, permute + cast), twice the GEMM's own time on a 7-8B model's
chunks. Here one pass does them all: each program takes a tile of channel pairs (a key channel
and its RoPE partner, or two neighbouring channels that do not rotate) over a tile of token
columns, reads both rows of the GEMM's output, applies steps, means and the rotation in registers
and stores the cast values straight into the chunks' outputs (read from a table of their
addresses). Before the GEMM, gather_twice makes its [q; q] operand from the chunks' uint8 samples in
one pass. The GEMM stays with cuBLAS (a Triton GEMM with gathered rows measured 2x slower). The
reference path (restore + emit) is the fallback and the tests' reference.
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
PAIR_FIELDS = 7  # row a, row b (within the block), layer * 2 + kind, head, channel a, channel b, rotates
BLOCK_M, BLOCK_N = 32, 64
GATHER_SLOTS, GATHER_COLS = 16, 128


def channel_partners(head_dim: int, rotating: np.ndarray, partner: np.ndarray) -> np.ndarray:
    """The pair of every channel: its RoPE partner where it rotates, else its neighbour (c ^ 1)
    where that does not rotate either, else itself."""
    ch = np.arange(head_dim)
    neighbour = ch ^ 1
    still = (neighbour < head_dim) & ~rotating[np.minimum(neighbour, head_dim - 1)]
    return np.where(rotating, partner, np.where(still, neighbour, ch))


def pair_table(rows: np.ndarray, blocks: int, d: int, shape: tuple[int, int, int], rope_pairs) -> np.ndarray:
    """(blocks, P, PAIR_FIELDS) int32: each block's channel pairs, P the most any block holds;
    padding pairs have layer * 2 + kind = -1. rows[i]: the GEMM row (j * d + r) of output element
    i in (layer, kind, head, channel) order (BatchedPlan.rows); rope_pairs: (partner, rotates) per
    head channel, or None (nothing rotates). Pure index arithmetic."""
    L, H, D = shape
    if rope_pairs is None:
        partner, rotating = np.arange(D), np.zeros(D, dtype=bool)
    else:
        partner, rotating = rope_pairs
    pairs = channel_partners(D, rotating, partner)
    firsts = np.flatnonzero(np.arange(D) <= pairs)
    lk, h, c = np.meshgrid(np.arange(2 * L), np.arange(H), firsts, indexing="ij")
    lk, h, c = lk.ravel(), h.ravel(), c.ravel()
    b = pairs[c]
    row_a, row_b = rows[(lk * H + h) * D + c], rows[(lk * H + h) * D + b]
    block = row_a // d
    if np.any(row_b // d != block):
        raise ValueError("a channel and its partner are restored by different GEMM blocks")
    rotates = (lk % 2 == 0) & rotating[c]
    fields = np.stack([row_a % d, row_b % d, lk, h, c, b, rotates], axis=1).astype(np.int32)
    order = np.argsort(block, kind="stable")
    counts = np.bincount(block, minlength=blocks)
    table = np.zeros((blocks, max(1, int(counts.max(initial=0))), PAIR_FIELDS), dtype=np.int32)
    table[:, :, 2] = -1
    within = np.arange(len(block)) - np.repeat(np.cumsum(counts) - counts, counts)
    table[block[order], within] = fields[order]
    return table


@dataclasses.dataclass(frozen=True)
class Launch:
    """What one fused restore needs beside the plan: the gathered integers and where they go."""

    x: torch.Tensor  # (J, d, N t) float32 basis products of the centred integers (before steps and means)
    cos: torch.Tensor  # (D, T) float32 (or a 1 x 1 dummy without RoPE)
    sin: torch.Tensor
    token_scales: torch.Tensor | None  # (N, t) float32 step multipliers
    meta: torch.Tensor  # (2 N,) int64 on the device: first positions, then output addresses
    tokens: int
    out_strides: tuple[int, ...]  # of every output (L, 2, t, H, D), in elements
    out_dtype: torch.dtype


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


def launch(plan, pairs: torch.Tensor, run: Launch) -> bool:
    """Run the kernel; False (and the fused path off for this process) where it fails to compile
    or launch, so the caller restores by the reference path."""
    global FUSED
    try:
        _launch(plan, pairs, run)
        return True
    except Exception as e:  # noqa: BLE001 - a broken toolchain or an unsupported GPU: fall back, once
        FUSED = False
        log.warning(
            "fused inverse transform unavailable (%s: %s): restoring with the reference kernels", type(e).__name__, e
        )
        return False


def _launch(plan, pairs: torch.Tensor, run: Launch) -> None:
    J, d, NT = run.x.shape
    P = pairs.shape[1]
    N = run.meta.numel() // 2
    ts = run.token_scales.reshape(-1) if run.token_scales is not None else run.cos
    grid = (J * triton_cdiv(P, BLOCK_M), triton_cdiv(NT, BLOCK_N))
    _kernel()[grid](
        run.x, plan.scales, plan.centred_means, pairs, run.cos, run.sin, ts, run.meta,
        d, P, NT, run.tokens, run.cos.shape[1], *run.out_strides, N,
        HAS_TS=run.token_scales is not None, OUT=OUT_DTYPES.index(run.out_dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4,
    )  # fmt: skip


def gather_twice(samples: torch.Tensor, gather: torch.Tensor, blocks: int, n: int) -> torch.Tensor | None:
    """(blocks, 2 n, N t) float16 [q; q] of N chunks' samples (N, C, t) uint8: each block slot's
    coded coordinate (gather[slot]: its row among the C), centred (sample - 128), written twice
    for the [hi | lo] GEMM; one pass instead of select, cast, centre and duplicate. None where the
    kernel fails (the fused path is then off for this process)."""
    global FUSED
    N, C, t = samples.shape
    out = torch.empty((blocks, 2 * n, N * t), dtype=torch.float16, device=samples.device)
    grid = (triton_cdiv(blocks * n, GATHER_SLOTS), triton_cdiv(N * t, GATHER_COLS))
    try:
        _gather_kernel()[grid](
            samples, gather, out, n, C, t, N * t, blocks * n, SLOTS=GATHER_SLOTS, COLS=GATHER_COLS, num_warps=4
        )
    except Exception as e:  # noqa: BLE001 - a broken toolchain or an unsupported GPU: fall back, once
        FUSED = False
        log.warning("fused gather unavailable (%s: %s): restoring with the reference kernels", type(e).__name__, e)
        return None
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    @triton.jit(do_not_specialize=["d", "P", "NT", "t", "table_len", "s_l", "s_kind", "s_tok", "s_head", "s_ch", "N"])
    def inverse_epilogue(
        x_ptr, scales_ptr, means_ptr, pairs_ptr, cos_ptr, sin_ptr, ts_ptr, meta_ptr,
        d, P, NT, t, table_len, s_l, s_kind, s_tok, s_head, s_ch, N,
        HAS_TS: tl.constexpr, OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        tiles = tl.cdiv(P, BLOCK_M)
        j = (tl.program_id(0) // tiles).to(tl.int64)
        m = (tl.program_id(0) % tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = pairs_ptr + (j * P + m) * 7
        lk = tl.load(pair + 2, mask=m < P, other=-1).to(tl.int64)
        m_ok = (m < P) & (lk >= 0)
        row_a = tl.load(pair, mask=m_ok, other=0).to(tl.int64)
        row_b = tl.load(pair + 1, mask=m_ok, other=0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ok = cols < NT
        keep = m_ok[:, None] & c_ok[None, :]
        scale = tl.load(scales_ptr + j)
        x_a = tl.load(x_ptr + (j * d + row_a)[:, None] * NT + cols[None, :], mask=keep, other=0.0) * scale
        x_b = tl.load(x_ptr + (j * d + row_b)[:, None] * NT + cols[None, :], mask=keep, other=0.0) * scale
        if HAS_TS:
            ts = tl.load(ts_ptr + cols, mask=c_ok, other=1.0)
            x_a = x_a * ts[None, :]
            x_b = x_b * ts[None, :]
        x_a = x_a + tl.load(means_ptr + j * d + row_a, mask=m_ok, other=0.0)[:, None]
        x_b = x_b + tl.load(means_ptr + j * d + row_b, mask=m_ok, other=0.0)[:, None]
        chunk = cols // t
        tok = cols - chunk * t
        pos = tl.load(meta_ptr + chunk, mask=c_ok, other=0) + tok
        ch_a = tl.load(pair + 4, mask=m_ok, other=0).to(tl.int64)
        ch_b = tl.load(pair + 5, mask=m_ok, other=0).to(tl.int64)
        turn = (tl.load(pair + 6, mask=m_ok, other=0) != 0)[:, None] & c_ok[None, :]
        cos_a = tl.load(cos_ptr + ch_a[:, None] * table_len + pos[None, :], mask=turn, other=1.0)
        sin_a = tl.load(sin_ptr + ch_a[:, None] * table_len + pos[None, :], mask=turn, other=0.0)
        cos_b = tl.load(cos_ptr + ch_b[:, None] * table_len + pos[None, :], mask=turn, other=1.0)
        sin_b = tl.load(sin_ptr + ch_b[:, None] * table_len + pos[None, :], mask=turn, other=0.0)
        y_a = x_b * sin_a + x_a * cos_a  # as the reference: partner * signed sin + own * cos
        y_b = x_a * sin_b + x_b * cos_b
        addr = tl.load(meta_ptr + N + chunk, mask=c_ok, other=0)
        if OUT == 0:
            out = addr.to(tl.pointer_type(tl.float16))
        elif OUT == 1:
            out = addr.to(tl.pointer_type(tl.bfloat16))
        else:
            out = addr.to(tl.pointer_type(tl.float32))
        head = tl.load(pair + 3, mask=m_ok, other=0).to(tl.int64)
        row_off = (lk >> 1) * s_l + (lk & 1) * s_kind + head * s_head
        col_off = tok.to(tl.int64) * s_tok
        tl.store(out[None, :] + (row_off + ch_a * s_ch)[:, None] + col_off[None, :], y_a, mask=keep)
        tl.store(out[None, :] + (row_off + ch_b * s_ch)[:, None] + col_off[None, :], y_b, mask=keep)

    return inverse_epilogue


@functools.cache
def _gather_kernel():
    triton, tl = triton_modules()

    @triton.jit(do_not_specialize=["n", "C", "t", "NT", "slots"])
    def gather_twice(samples_ptr, gather_ptr, out_ptr, n, C, t, NT, slots, SLOTS: tl.constexpr, COLS: tl.constexpr):
        slot = tl.program_id(0) * SLOTS + tl.arange(0, SLOTS)
        s_ok = slot < slots
        row = tl.load(gather_ptr + slot, mask=s_ok, other=0)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        c_ok = cols < NT
        chunk = (cols // t).to(tl.int64)
        tok = cols - (cols // t) * t
        keep = s_ok[:, None] & c_ok[None, :]
        src = samples_ptr + (chunk * C * t + tok)[None, :] + (row * t)[:, None]
        q = (tl.load(src, mask=keep, other=128).to(tl.float32) - 128.0).to(tl.float16)
        j = (slot // n).to(tl.int64)
        k = (slot - (slot // n) * n).to(tl.int64)
        first = out_ptr + (j * 2 * n + k)[:, None] * NT + cols[None, :]
        tl.store(first, q, mask=keep)
        tl.store(first + n * NT, q, mask=keep)

    return gather_twice
