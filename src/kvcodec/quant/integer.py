"""Per-channel min-max integer quantization (pure functions on torch tensors).

Parameters are computed per (layer, K/V, head, channel) over the tokens of one chunk. Offsets are
rounded down and steps rounded up to fp16 so the side information is small and the stored
parameters still cover every value: |x - dequantize(quantize(x))| <= step / 2.
"""

from __future__ import annotations

import torch


def levels(bits: torch.Tensor | int) -> torch.Tensor | int:
    return (1 << bits) - 1 if isinstance(bits, int) else (2 ** bits.to(torch.int64) - 1)


def minmax_params(x: torch.Tensor, bits_per_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (layers, 2, tokens, heads, dim) float. Returns (offset, step), each (layers, 2, heads, dim),
    with offset <= min(x) and offset + step * (2**bits - 1) >= max(x) per channel. Parameters are
    fp16 (rounded outward) when the values allow it, fp32 otherwise."""
    lo = x.amin(dim=2).float()  # min and max are exact in x's own dtype: no float copy of x
    hi = x.amax(dim=2).float()
    n = levels(bits_per_layer).to(device=x.device, dtype=torch.float32).view(-1, 1, 1, 1)
    if max(lo.abs().max().item(), hi.abs().max().item()) > 30000.0:
        return lo, _wide_step(lo, hi, n)
    offset = _round_fp16(lo, down=True)
    step = _round_fp16((hi - offset.float()) / n, down=False)
    step = torch.where(step > 0, step, torch.ones_like(step))
    # fp32 rounding of offset + step * n can still land just below the max: nudge the step up.
    for _ in range(8):
        short = offset.float() + step.float() * n < hi
        if not short.any():
            break
        step = torch.where(short, _next_fp16(step, up=True), step)
    return offset, step


def _wide_step(lo: torch.Tensor, hi: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """fp32 steps for values beyond fp16 range. hi - lo of values near +-3e38 overflows fp32, so
    the step is computed in float64 and rounded up to fp32 (it stays finite: n >= 3)."""
    exact = (hi.double() - lo.double()) / n.double()
    step = exact.float()
    step = torch.where(step.double() < exact, _next_up(step), step)
    return torch.where(step > 0, step, torch.ones_like(step))


def quantize(x: torch.Tensor, offset: torch.Tensor, step: torch.Tensor, bits_per_layer: torch.Tensor) -> torch.Tensor:
    """Integers in [0, 2**bits - 1] as uint8, shape of x."""
    # fp32 parameters mean values beyond fp16 range, where x - offset can overflow fp32
    work = torch.float64 if offset.dtype == torch.float32 else torch.float32
    n = levels(bits_per_layer).to(device=x.device, dtype=work).view(-1, 1, 1, 1, 1)
    q = x.to(work, copy=True)  # one working copy, then in place: the same values as out of place
    q.sub_(offset.to(work).unsqueeze(2)).div_(step.to(work).unsqueeze(2)).round_().clamp_(min=0)
    return torch.minimum(q, n, out=q).to(torch.uint8)


def dequantize(q: torch.Tensor, offset: torch.Tensor, step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize up to half a step. q: (layers, 2, tokens, heads, dim); offset/step:
    (layers, 2, heads, dim).

    offset + q * step is exact in float64 (a <= 8-bit integer times an fp16/fp32 step plus an
    offset) and is rounded once to float32: the result a fused multiply-add in float32 gives,
    which is what the fused GPU restorer computes, so every decoder yields the same values."""
    exact = offset.double().unsqueeze(2) + q.double() * step.double().unsqueeze(2)
    return exact.float().to(dtype)


def _round_fp16(v: torch.Tensor, down: bool) -> torch.Tensor:
    h = v.to(torch.float16)
    bad = (h.float() > v) if down else (h.float() < v)
    return torch.where(bad, _next_fp16(h, up=not down), h)


def _next_up(v: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(v, torch.full_like(v, float("inf")))


def _next_fp16(h: torch.Tensor, up: bool) -> torch.Tensor:
    return torch.nextafter(h, torch.full_like(h, float("inf") if up else float("-inf")))
