"""The transform's inverse around cuBLAS's GEMM as two Triton kernels (CUDA; the float16 GEMM's
conditions): the gather before it and the epilogue after it.

transform_kernels.restore runs the batched inverse transform as select, cast and centre, the float16
GEMM (cuBLAS, tensor cores), then about eight float32 passes over every value (steps, means, row
order, RoPE's partner gather, multiply and add, permute + cast): more than the GEMM's own time on a
7-8B model's chunks. Here gather_centred makes the GEMM's q operand from the chunks' uint8 samples
in one pass (reading each chunk where it lies: meta_table; a program takes block slots over the
tokens of one chunk, in 16-byte vectors where gather_aligned(): 0.5 ms a 1 GB batch, against 0.9
with tiles across chunks), and the epilogue does the rest in one more, a chunk's exact sink tokens
included: each program takes one (layer, kind, head) of the batch, all its channels over a tile of
token columns, as pairs of channels that RoPE rotates into each other (channel_pairs; c and c + D/2
for rotate-half heads); it reads the GEMM's rows of both channels of each pair once (consecutive
rows: unit_table), applies the blocks' scales, the token scales, the means and the rotation in
registers, and stores the cast values straight into the chunks' outputs (a table of their
addresses), whole heads per token, so the writes are contiguous along the channels. Where the tile
lies in one chunk and the outputs are aligned (regular(), the usual case) the compiler is told so
and loads and stores in 16-byte vectors (a 7-8B model's 1 GB batch: 1.45 ms, against 4.0 by the
general variant's scalar accesses and 5.0 by the previous one-channel-per-row epilogue). The GEMM
stays with cuBLAS: a Triton GEMM with this epilogue fused into it measured 9 ms a 1 GB batch, where
cuBLAS and the epilogue take 1.6 + 1.5. Few kernels matter beside a busy GPU more than idle: each
waits for the SMs on its own (a traced fetch beside a looping bf16 matmul: 1-2 ms per kernel). The
reference kernels (restore + emit) are the fallback and the tests' reference.
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
EPILOGUE_WARPS = 4  # 8 measured as fast in one sweep, 9% slower in another (probes/restore_kernels.py --sweep)
GATHER_SLOTS, GATHER_COLS = 8, 256  # a program's block slots x tokens, within one chunk


def channel_pairs(partner: np.ndarray, rotating: np.ndarray) -> np.ndarray:
    """(3, ceil(D / 2)) int32 the epilogue's channel pairs of a head: (lo, hi, rotates). A RoPE
    channel is paired with its partner (lo the smaller), the channels that do not rotate with each
    other (first half with second half; an odd one out gets hi = D: none). A program holds both
    channels of each pair, so the rotation reads a channel's partner from registers, not from
    memory a second time. Pure."""
    D = partner.size
    rot = [(c, int(partner[c])) for c in range(D) if rotating[c] and c < partner[c]]
    rest = [c for c in range(D) if not rotating[c]]
    half = (len(rest) + 1) // 2
    pairs = rot + [(rest[i], rest[i + half] if i + half < len(rest) else D) for i in range(half)]
    lo, hi = (np.array(side, dtype=np.int32) for side in zip(*pairs))
    return np.stack([lo, hi, np.array([bool(rotating[c]) for c in lo], dtype=np.int32)])


def unit_table(rows: np.ndarray, shape: tuple[int, int, int], rope_pairs) -> tuple[np.ndarray, np.ndarray]:
    """The epilogue's index tables: (L * 2 * H,) int64 GEMM row (j * d + r) of channel 0 of every
    (layer, kind, head), whose channels follow it row by row, and its channel pairs (channel_pairs).
    rows[i]: the GEMM row of output element i in (layer, kind, head, channel) order
    (BatchedPlan.rows); rope_pairs: (partner, rotates) per head channel, or None. Pure index
    arithmetic."""
    L, H, D = shape
    heads = rows.reshape(L * 2 * H, D)
    if np.any(heads != heads[:, :1] + np.arange(D)):
        raise ValueError("a head's channels are not consecutive rows of the GEMM's output")
    partner, rotating = (np.arange(D), np.zeros(D, dtype=bool)) if rope_pairs is None else rope_pairs
    return heads[:, 0].astype(np.int64), channel_pairs(partner, rotating)


def halves(pairs: np.ndarray, head_dim: int) -> bool:
    """The pairs are (c, c + P) for c < P = head_dim / 2 (a head whose RoPE rotates halves, or
    none): the kernel computes them without the table."""
    P = pairs.shape[1]
    return head_dim == 2 * P and bool(np.array_equal(pairs[:2], np.stack([np.arange(P), np.arange(P) + P])))


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
    regular: bool = False  # regular(): the kernel's vector loads and stores hold


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


def regular(tokens: int, outs) -> bool:  # noqa: ANN001
    """Each token tile of the epilogue lies in one chunk (tokens a multiple of BLOCK_N) and the
    outputs' addresses and strides (but the channels', 1) are multiples of 16: vector loads and
    stores. A chunk of any other length restores by the kernel's general variant."""
    s_l, s_kind, s_tok, s_head, s_ch = outs[0].stride()
    strides = (s_l, s_kind, s_tok, s_head)
    return (
        tokens % BLOCK_N == 0
        and s_ch == 1
        and all(v % 16 == 0 for v in strides)
        and all(o.data_ptr() % 16 == 0 for o in outs)
    )


# chunk lengths that compile both variants of both kernels: one whole tile (rows 16-byte aligned), and
# a length that is neither a multiple of BLOCK_N nor of 16 (gather_aligned)
WARM_TOKENS = (BLOCK_N, BLOCK_N - 8)


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
    N, P, D = NT // run.tokens, plan.pairs.shape[1], plan.rows.numel() // plan.units.numel()
    ts = run.token_scales.reshape(-1) if run.token_scales is not None else run.cos
    s_l, s_kind, s_tok, s_head, s_ch = run.out_strides
    grid = (plan.units.numel() * _cdiv(NT, BLOCK_N),)
    with torch.cuda.device(run.x.device):  # Triton launches on the current device's current stream
        _kernel()[grid](
            run.x, plan.scales, plan.centred_means, plan.units, plan.pairs, run.cos, run.sin, ts, run.meta,
            d, NT, run.tokens, run.cos.shape[1], s_l, s_kind, s_tok, s_head, s_ch, N, run.heads, P, D,
            HAS_TS=run.token_scales is not None, HAS_SINK=run.sinks, OUT=OUT_DTYPES.index(run.out_dtype),
            HALVES=plan.halves, REGULAR=run.regular, BLOCK_P=_next_pow2(P), BLOCK_N=BLOCK_N, num_warps=EPILOGUE_WARPS,
        )  # fmt: skip


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def gather_centred(
    table: torch.Tensor, gather: torch.Tensor, t: int, N: int, aligned: bool = False
) -> torch.Tensor | None:
    """(slots, N t) float16 q of N chunks' samples, (C, t) uint8 each at the addresses `table`
    ((N,) int64 on the device) holds: each block slot's coded coordinate (gather[slot]: its row
    among the C), centred (sample - 128); one pass instead of stack, select, cast and centre.
    aligned: gather_aligned() holds (vector loads). None where the kernel fails (the fused path is
    then off for this process)."""
    global FUSED
    slots = gather.numel()
    out = torch.empty((slots, N * t), dtype=torch.float16, device=table.device)
    grid = (_cdiv(slots, GATHER_SLOTS), N * _cdiv(t, GATHER_COLS))
    try:
        with torch.cuda.device(table.device):
            _gather_kernel()[grid](
                table, gather, out, t, slots, ALIGNED=aligned and t % 16 == 0,
                SLOTS=GATHER_SLOTS, COLS=GATHER_COLS, num_warps=4,
            )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a broken toolchain or an unsupported GPU: fall back, once
        FUSED = False
        log.warning("fused gather unavailable (%s: %s): restoring with the reference kernels", type(e).__name__, e)
        return None
    return out


def gather_aligned(chunks) -> bool:  # noqa: ANN001
    """Every chunk's (C, t) samples start at a multiple of 16 bytes and t is one: each row of a
    chunk is 16-byte aligned, and the gather loads 16-byte vectors."""
    return all(c.shape[1] % 16 == 0 and c.data_ptr() % 16 == 0 for c in chunks)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    # no integer is specialized on but s_ch (1: dense heads) and D: one compiled variant per flag set,
    # which warm-up compiles. REGULAR says what the compiler cannot see (regular()), written as
    # (v // 16) * 16 so that it can: vector loads and stores
    @triton.jit(do_not_specialize=["d", "NT", "t", "table_len", "s_l", "s_kind", "s_tok", "s_head", "N", "H", "P"])
    def inverse_epilogue(
        x_ptr, scales_ptr, means_ptr, units_ptr, pairs_ptr, cos_ptr, sin_ptr, ts_ptr, meta_ptr,
        d, NT, t, table_len, s_l, s_kind, s_tok, s_head, s_ch, N, H, P, D,
        HAS_TS: tl.constexpr, HAS_SINK: tl.constexpr, OUT: tl.constexpr, HALVES: tl.constexpr,
        REGULAR: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        if REGULAR:
            NT = (NT // 16) * 16
            s_l = (s_l // 16) * 16
            s_kind = (s_kind // 16) * 16
            s_tok = (s_tok // 16) * 16
            s_head = (s_head // 16) * 16
        # the H heads of one (layer, kind) side by side on one column tile, then the next tile
        pid = tl.program_id(0)
        n_cols = (NT + BLOCK_N - 1) // BLOCK_N
        layer_kind = pid // (H * n_cols)
        rest = pid - layer_kind * (H * n_cols)
        col_tile = rest // H
        u = layer_kind * H + rest % H
        row0 = tl.load(units_ptr + u)
        p = tl.arange(0, BLOCK_P)
        p_ok = p < P
        if HALVES:  # channel c pairs with c + P (RoPE's rotate-half): contiguous rows and stores
            lo = p
            hi = p + P
            hi_ok = p_ok
        else:
            lo = tl.load(pairs_ptr + p, mask=p_ok, other=0)
            hi = tl.load(pairs_ptr + P + p, mask=p_ok, other=D)
            hi_ok = hi < D
            hi = tl.where(hi_ok, hi, 0)
        cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols < NT
        keep_lo = p_ok[:, None] & n_ok[None, :]
        keep_hi = hi_ok[:, None] & n_ok[None, :]
        scale = tl.load(scales_ptr + row0 // d)
        x_lo = tl.load(x_ptr + (row0 + lo).to(tl.int64)[:, None] * NT + cols[None, :], mask=keep_lo, other=0.0)
        x_hi = tl.load(x_ptr + (row0 + hi).to(tl.int64)[:, None] * NT + cols[None, :], mask=keep_hi, other=0.0)
        x_lo = x_lo * scale
        x_hi = x_hi * scale
        if HAS_TS:
            ts = tl.load(ts_ptr + cols, mask=n_ok, other=1.0)
            x_lo = x_lo * ts[None, :]
            x_hi = x_hi * ts[None, :]
        x_lo += tl.load(means_ptr + row0 + lo, mask=p_ok, other=0.0)[:, None]
        x_hi += tl.load(means_ptr + row0 + hi, mask=hi_ok, other=0.0)[:, None]
        if REGULAR:  # the tile lies in one chunk: its position, output and sink are scalars
            chunk = (col_tile * BLOCK_N) // t
            tok = col_tile * BLOCK_N - chunk * t + tl.arange(0, BLOCK_N)
            pos = tl.load(meta_ptr + chunk) + tok
        else:
            chunk = cols // t
            tok = cols - chunk * t
            pos = tl.load(meta_ptr + chunk, mask=n_ok, other=0) + tok
        turn = (tl.load(pairs_ptr + 2 * P + p, mask=p_ok, other=0) != 0) & ((u // H) % 2 == 0)  # keys only
        rotate = turn[:, None] & n_ok[None, :]
        at_lo = lo.to(tl.int64)[:, None] * table_len + pos[None, :]
        at_hi = hi.to(tl.int64)[:, None] * table_len + pos[None, :]
        # as the reference: own * cos + partner * signed sin, each channel with its own table row
        cos_lo = tl.load(cos_ptr + at_lo, mask=rotate, other=1.0)
        y_lo = x_lo * cos_lo + x_hi * tl.load(sin_ptr + at_lo, mask=rotate, other=0.0)
        cos_hi = tl.load(cos_ptr + at_hi, mask=rotate, other=1.0)
        y_hi = x_hi * cos_hi + x_lo * tl.load(sin_ptr + at_hi, mask=rotate, other=0.0)
        if HAS_SINK:  # a chunk's first tokens kept exact: its sink's values, not the restored ones
            if REGULAR:
                sink_len = tl.load(meta_ptr + 4 * N + chunk)
                sink = tl.load(meta_ptr + 3 * N + chunk).to(tl.pointer_type(tl.float16))
                in_sink = n_ok & (tok < sink_len)
            else:
                sink_len = tl.load(meta_ptr + 4 * N + chunk, mask=n_ok, other=0)
                in_sink = n_ok & (tok < sink_len)
                sink = tl.load(meta_ptr + 3 * N + chunk, mask=in_sink, other=0).to(tl.pointer_type(tl.float16))
            at_sink = (((u // H).to(tl.int64) * sink_len + tok) * H + u % H) * D  # (layer * 2 + kind, s, H, D)
            exact_lo = tl.load(sink + at_sink[None, :] + lo[:, None], mask=keep_lo & in_sink[None, :])
            exact_hi = tl.load(sink + at_sink[None, :] + hi[:, None], mask=keep_hi & in_sink[None, :])
            y_lo = tl.where(in_sink[None, :], exact_lo.to(tl.float32), y_lo)
            y_hi = tl.where(in_sink[None, :], exact_hi.to(tl.float32), y_hi)
        if REGULAR:
            addr = (tl.load(meta_ptr + N + chunk) // 16) * 16
        else:
            addr = tl.load(meta_ptr + N + chunk, mask=n_ok, other=0)
        if OUT == 0:
            out = addr.to(tl.pointer_type(tl.float16))
        elif OUT == 1:
            out = addr.to(tl.pointer_type(tl.bfloat16))
        else:
            out = addr.to(tl.pointer_type(tl.float32))
        unit = (u // (2 * H)).to(tl.int64) * s_l + ((u // H) % 2).to(tl.int64) * s_kind + (u % H).to(tl.int64) * s_head
        if REGULAR:
            at = out + unit + tok.to(tl.int64)[None, :] * s_tok
        else:
            at = out[None, :] + unit + tok.to(tl.int64)[None, :] * s_tok
        if OUT == 0:  # as transform_kernels.clamp_to_range_ (bfloat16's range cannot be overshot from float16)
            y_lo = tl.clamp(y_lo, -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL)
            y_hi = tl.clamp(y_hi, -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL)
        tl.store(at + (lo * s_ch)[:, None], y_lo, mask=keep_lo)
        tl.store(at + (hi * s_ch)[:, None], y_hi, mask=keep_hi)

    return inverse_epilogue


@functools.cache
def _gather_kernel():
    triton, tl = triton_modules()

    # a program takes SLOTS block slots over COLS tokens of ONE chunk: one sample address, rows
    # contiguous along the tokens. ALIGNED says what the compiler cannot see (gather_aligned()), as
    # (v // 16) * 16 so that it can: vector loads and stores
    @triton.jit(do_not_specialize=["t", "slots"])
    def gather_centred(
        table_ptr, gather_ptr, out_ptr, t, slots, ALIGNED: tl.constexpr, SLOTS: tl.constexpr, COLS: tl.constexpr
    ):
        if ALIGNED:
            t = (t // 16) * 16
        tiles = (t + COLS - 1) // COLS
        chunk = tl.program_id(1) // tiles
        tok = (tl.program_id(1) - chunk * tiles) * COLS + tl.arange(0, COLS)
        slot = tl.program_id(0) * SLOTS + tl.arange(0, SLOTS)
        s_ok = slot < slots
        row = tl.load(gather_ptr + slot, mask=s_ok, other=0)
        keep = s_ok[:, None] & (tok < t)[None, :]
        base = tl.load(table_ptr + chunk)
        if ALIGNED:
            base = (base // 16) * 16
        src = base.to(tl.pointer_type(tl.uint8)) + (row * t)[:, None] + tok[None, :]
        q = (tl.load(src, mask=keep, other=128).to(tl.float32) - 128.0).to(tl.float16)
        NT = tl.num_programs(1) // tiles * t
        at = slot.to(tl.int64)[:, None] * NT + (chunk * t + tok)[None, :]
        tl.store(out_ptr + at, q, mask=keep)

    return gather_centred
