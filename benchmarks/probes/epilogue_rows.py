"""A candidate for the transform's epilogue, token-major (an experiment, not the product's kernel).

restore.transform_triton's epilogue reads the GEMM's products x (J, d, N t) along the tokens and
writes each head along its channels: the compiler turns every tile around in shared memory between
the two, and the epilogue runs at ~2.3x its memory traffic (1.45-1.6 ms per GB of fp16 KV on
Llama-8B-shaped chunks, fetch-h200-s46-gather-ab-llama). Here cuBLAS writes the products
token-major instead, x_t (J, N t, d) = q^T @ half^T (the same GEMM with its operands' transpose
flags swapped), and RoPE's tables are read position-major (T, D), so that the epilogue loads and
stores every tile along the channels. Same math as the product's kernel (scales, token scales,
means, rotation, sinks, cast), same plan and launch record.

restore_kernels.py --rows times it beside the product's kernels and checks its outputs against the
product's; tests/test_transform_fused.py checks its source under Triton's interpreter. Move it into
restore.transform_triton if it measures faster.
"""

from __future__ import annotations

import functools

import torch

from kvcodec.restore import transform_triton as tt
from kvcodec.restore.triton_restore import triton_modules


def rows_gemm(plan, q: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """(J, N t, d) float32 products, token-major: q (J n, N t) float16 against the decode basis."""
    J, n = plan.half.shape[0], plan.n
    qt = q.view(J, n, -1).transpose(1, 2)
    if q.device.type == "cuda":
        return torch.bmm(qt, plan.half.transpose(1, 2), out_dtype=torch.float32)
    return torch.bmm(qt.float(), plan.half.float().transpose(1, 2))


def position_major(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's (D, T) tables as (T, D), contiguous."""
    return cos.T.contiguous(), sin.T.contiguous()


def launch(plan, run: tt.Launch, cos_t: torch.Tensor, sin_t: torch.Tensor, warps: int = 4) -> None:  # noqa: ANN001
    """The epilogue of `run` (its x token-major: rows_gemm; cos_t / sin_t: position_major)."""
    J, NT, d = run.x.shape
    N, P, D = NT // run.tokens, plan.pairs.shape[1], plan.rows.numel() // plan.units.numel()
    ts = run.token_scales.reshape(-1) if run.token_scales is not None else cos_t
    s_l, s_kind, s_tok, s_head, s_ch = run.out_strides
    grid = (plan.units.numel() * -(-NT // tt.BLOCK_N),)
    with torch.cuda.device(run.x.device):
        _kernel()[grid](
            run.x, plan.scales, plan.centred_means, plan.units, plan.pairs, cos_t, sin_t, ts, run.meta,
            d, NT, run.tokens, D if cos_t.numel() > 1 else 0, s_l, s_kind, s_tok, s_head, s_ch, N, run.heads,
            P, D, HAS_TS=run.token_scales is not None, HAS_SINK=run.sinks, OUT=tt.OUT_DTYPES.index(run.out_dtype),
            HALVES=plan.halves, REGULAR=run.regular and d % 8 == 0, BLOCK_P=tt._next_pow2(P), BLOCK_N=tt.BLOCK_N,
            num_warps=warps,
        )  # fmt: skip


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    @triton.jit(do_not_specialize=["d", "NT", "t", "row_len", "s_l", "s_kind", "s_tok", "s_head", "N", "H", "P"])
    def rows_epilogue(
        x_ptr, scales_ptr, means_ptr, units_ptr, pairs_ptr, cos_ptr, sin_ptr, ts_ptr, meta_ptr,
        d, NT, t, row_len, s_l, s_kind, s_tok, s_head, s_ch, N, H, P, D,
        HAS_TS: tl.constexpr, HAS_SINK: tl.constexpr, OUT: tl.constexpr, HALVES: tl.constexpr,
        REGULAR: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        if REGULAR:  # d: a multiple of 8 (GEMM_ALIGN), so every head's row of x starts 32 bytes in
            d = (d // 8) * 8
            NT = (NT // 16) * 16
            s_l = (s_l // 16) * 16
            s_kind = (s_kind // 16) * 16
            s_tok = (s_tok // 16) * 16
            s_head = (s_head // 16) * 16
        pid = tl.program_id(0)
        n_cols = (NT + BLOCK_N - 1) // BLOCK_N
        layer_kind = pid // (H * n_cols)
        rest = pid - layer_kind * (H * n_cols)
        col_tile = rest // H
        u = layer_kind * H + rest % H
        row0 = tl.load(units_ptr + u)
        j = row0 // d
        p = tl.arange(0, BLOCK_P)
        p_ok = p < P
        if HALVES:
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
        keep_lo = n_ok[:, None] & p_ok[None, :]
        keep_hi = n_ok[:, None] & hi_ok[None, :]
        scale = tl.load(scales_ptr + j)
        at_x = j * NT * d + cols.to(tl.int64)[:, None] * d + (row0 - j * d)
        x_lo = tl.load(x_ptr + at_x + lo[None, :], mask=keep_lo, other=0.0) * scale
        x_hi = tl.load(x_ptr + at_x + hi[None, :], mask=keep_hi, other=0.0) * scale
        if HAS_TS:
            ts = tl.load(ts_ptr + cols, mask=n_ok, other=1.0)
            x_lo = x_lo * ts[:, None]
            x_hi = x_hi * ts[:, None]
        x_lo += tl.load(means_ptr + row0 + lo, mask=p_ok, other=0.0)[None, :]
        x_hi += tl.load(means_ptr + row0 + hi, mask=hi_ok, other=0.0)[None, :]
        if REGULAR:
            chunk = (col_tile * BLOCK_N) // t
            tok = col_tile * BLOCK_N - chunk * t + tl.arange(0, BLOCK_N)
            pos = tl.load(meta_ptr + chunk) + tok
        else:
            chunk = cols // t
            tok = cols - chunk * t
            pos = tl.load(meta_ptr + chunk, mask=n_ok, other=0) + tok
        turn = (tl.load(pairs_ptr + 2 * P + p, mask=p_ok, other=0) != 0) & ((u // H) % 2 == 0)
        rotate = n_ok[:, None] & turn[None, :]
        at_pos = pos.to(tl.int64)[:, None] * row_len
        cos_lo = tl.load(cos_ptr + at_pos + lo[None, :], mask=rotate, other=1.0)
        y_lo = x_lo * cos_lo + x_hi * tl.load(sin_ptr + at_pos + lo[None, :], mask=rotate, other=0.0)
        cos_hi = tl.load(cos_ptr + at_pos + hi[None, :], mask=rotate, other=1.0)
        y_hi = x_hi * cos_hi + x_lo * tl.load(sin_ptr + at_pos + hi[None, :], mask=rotate, other=0.0)
        if HAS_SINK:
            if REGULAR:
                sink_len = tl.load(meta_ptr + 4 * N + chunk)
                sink = tl.load(meta_ptr + 3 * N + chunk).to(tl.pointer_type(tl.float16))
                in_sink = n_ok & (tok < sink_len)
            else:
                sink_len = tl.load(meta_ptr + 4 * N + chunk, mask=n_ok, other=0)
                in_sink = n_ok & (tok < sink_len)
                sink = tl.load(meta_ptr + 3 * N + chunk, mask=in_sink, other=0).to(tl.pointer_type(tl.float16))
            at_sink = (((u // H).to(tl.int64) * sink_len + tok) * H + u % H) * D
            if REGULAR:
                exact = sink + at_sink[:, None]
            else:
                exact = sink[:, None] + at_sink[:, None]
            exact_lo = tl.load(exact + lo[None, :], mask=keep_lo & in_sink[:, None])
            exact_hi = tl.load(exact + hi[None, :], mask=keep_hi & in_sink[:, None])
            y_lo = tl.where(in_sink[:, None], exact_lo.to(tl.float32), y_lo)
            y_hi = tl.where(in_sink[:, None], exact_hi.to(tl.float32), y_hi)
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
            at = out + unit + tok.to(tl.int64)[:, None] * s_tok
        else:
            at = out[:, None] + unit + tok.to(tl.int64)[:, None] * s_tok
        tl.store(at + (lo * s_ch)[None, :], y_lo, mask=keep_lo)
        tl.store(at + (hi * s_ch)[None, :], y_hi, mask=keep_hi)

    return rows_epilogue
