"""What the transform codec makes of a KV at a target ratio, without entropy-coding it: the integers
it would code (the codec's own quantizer, finer tail and fp16 sink tokens), the KV its decoder would
restore from them (the CPU reference math), and the bytes the coder would spend, estimated as the
per-chunk order-0 entropy of those integers times the coder's overhead over that entropy,
measured by one real chunk encode. The coders are lossless, so the restored KV is exactly the codec's;
only the size is an estimate (checked against real encodes: benchmarks/results/report-estimate-*.md).

Calibration's quality report uses it: a zstd-19 or HEVC trial encode of every held-out text at every
ratio costs minutes of CPU, this a few seconds."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import zstandard

from kvcodec.transform import alloc, inverse, quantize, rate
from kvcodec.transform.calibration import all_variances
from kvcodec.transform.rope import apply_rope

# A first guess of the coded payload over the order-0 entropy of the same integers
# (rate.column_entropy_bits), before one chunk's real encode measures it (benchmarks/results/report-estimate-smollm2-cpu.md).
CODER_GAP = {"zstd": 1.06, "hevc": 1.09, "mixed": 1.075}
SEARCH_TOLERANCE = 0.002  # relative size error at which the level search stops


@dataclasses.dataclass(frozen=True)
class Simulated:
    restored: torch.Tensor  # (layers, 2, T, H, D) float32, what the decoder returns
    bytes: float  # estimated coded bytes (all chunks, sink tokens included)
    theta: float  # the distortion level
    gap: float  # the coder's payload over the entropy, measured on one chunk


def _chunks(codec: Any, tokens: int) -> list[tuple[int, int, int]]:
    """(start, end, finer tail tokens) per chunk, as encode_chunks cuts a KV starting at position 0."""
    out = []
    for s in range(0, tokens, codec.chunk_tokens):
        e = min(tokens, s + codec.chunk_tokens)
        fine = max(0, e - max(s, tokens - codec.fine_tokens)) if codec.fine_bits else 0
        out.append((s, e, fine))
    return out


def _sink_bytes(codec: Any, kv: torch.Tensor) -> int:
    sink = min(codec.sink_tokens, kv.shape[2])
    if not sink:
        return 0
    raw = kv[:, :, :sink].to(torch.float16).cpu().contiguous().numpy().tobytes()
    return len(zstandard.ZstdCompressor(level=19).compress(raw))


def entropy_bits(codec: Any, y: torch.Tensor, theta: float) -> float:
    """Order-0 bits of the integers of every chunk of coefficients y at level theta (each chunk its
    own per-coordinate models, sink tokens zeroed as the codec codes them). A chunk's finer tail is
    priced as the codec's size search prices it: its tokens at the per-token rate of the whole chunk
    coded fine. One histogram over coarse and fine tokens together (their mixture) overstated the
    last chunk by ~3% against real HEVC bytes (SmolLM2, pg/want, 5x and 10x), and a histogram of the
    tail alone (16 samples a column) understated it."""
    total = 0.0
    for s, e, f in _chunks(codec, len(y)):
        coarse = rate.column_entropy_bits(codec._symbols(y[s:e], theta, s, 0))
        if f:
            fine = rate.column_entropy_bits(codec._symbols(y[s:e], theta, s, e - s))
            coarse = ((e - s - f) * coarse + f * fine) / (e - s)
        total += coarse
    return total


def _solve(size, target: float, a: float, b: float) -> float:
    """log theta in [a, b] where the decreasing size(log theta) meets target (regula falsi on log size)."""

    def f(x: float) -> float:
        return math.log(max(size(x), 1e-9)) - math.log(target)

    fa, fb = f(a), f(b)
    if fa <= 0:
        return a
    if fb >= 0:
        return b
    side = 0
    for _ in range(40):
        c = (a * fb - b * fa) / (fb - fa)
        fc = f(c)
        if abs(fc) < SEARCH_TOLERANCE:
            return c
        if fc > 0:
            a, fa = c, fc
            fb, side = (fb / 2 if side == 1 else fb), 1
        else:
            b, fb = c, fc
            fa, side = (fa / 2 if side == -1 else fa), -1
    return b


def level_for_ratio(codec: Any, kv: torch.Tensor, ratio: float, y: torch.Tensor | None = None) -> tuple[float, float]:
    """(theta, gap): the level at which kv's coded payload is the codec's budget for `ratio` (2 *
    numel / ratio bytes less the fp16 sink tokens, as TransformCodec budgets it), the payload
    modelled as entropy x gap with the gap measured by one real chunk encode at a first guess."""
    y = codec.coefficients(kv, 0) if y is None else y
    T = kv.shape[2]
    sink_values = min(codec.sink_tokens, T) * (kv.numel() // T)
    target = 2.0 * kv.numel() / ratio - 2.0 * sink_values
    top = max(float(b.variances.max()) for b in codec.cal.bases.values())
    if target <= 0:
        return top * 0.999, CODER_GAP[codec.coder]
    gap = CODER_GAP[codec.coder]
    guess = math.log(alloc.water_level(all_variances(codec.cal), 16.0 / ratio, iters=30))  # modelled: a bracket

    def solve(centre: float, width: float) -> float:
        lo, hi = max(centre - width, math.log(top * rate.MIN_LEVEL)), min(centre + width, math.log(top * 0.999))
        return _solve(lambda x: entropy_bits(codec, y, math.exp(x)) / 8 * gap, target, lo, hi)

    theta = math.exp(solve(guess, 3.0))
    s = codec.chunk_tokens if codec.chunk_tokens < T else 0  # a chunk without sink tokens where there is one
    e = min(T, s + codec.chunk_tokens)
    bits = rate.column_entropy_bits(codec._symbols(y[s:e], theta, s, 0))
    if bits > 0:
        gap = codec._payload_bytes(y[s:e], kv[:, :, s:e], theta, s) * 8.0 / bits
    x = solve(math.log(theta), 0.5)
    return math.exp(x), gap


@torch.inference_mode()
def restore(codec: Any, kv: torch.Tensor, theta: float, y: torch.Tensor | None = None) -> torch.Tensor:
    """The KV the decoder restores from kv coded at level theta (CPU reference math, float32)."""
    y = codec.coefficients(kv, 0) if y is None else y
    cal, plan = codec.cal, codec.plan(theta)
    L, _, T, H, D = kv.shape
    out = torch.empty((L, 2, T, H, D), dtype=torch.float32)
    bases = [(b.mean, b.basis) for b in inverse.decode_bases(cal, plan.counts, plan.steps)]
    for s, e, fine in _chunks(codec, T):
        q = codec._symbols(y[s:e], theta, s, fine).cpu()
        scale = quantize.token_scales(e - s, fine, codec.fine_bits) if fine else None
        coeffs = quantize.dequantize(q, plan.steps, token_scale=scale, sigmas=plan.sigmas, recon=codec.recon)
        out[:, :, s:e] = inverse.inverse(cal, bases, (coeffs / plan.steps).T.contiguous(), (L, H, D))
    if cal.rope is not None:
        out[:, 0] = apply_rope(out[:, 0], torch.arange(T), cal.rope)
    sink = min(codec.sink_tokens, T)
    out[:, :, :sink] = kv[:, :, :sink].to(torch.float16).to(torch.float32)
    return out


def simulate(codec: Any, kv: torch.Tensor, ratio: float) -> Simulated:
    """kv (layers, 2, T, H, D) at target `ratio` vs fp16: restored KV, estimated bytes, level, gap."""
    y = codec.coefficients(kv, 0)
    theta, gap = level_for_ratio(codec, kv, ratio, y)
    nbytes = entropy_bits(codec, y, theta) / 8 * gap + _sink_bytes(codec, kv)
    return Simulated(restore(codec, kv, theta, y), nbytes, theta, gap)
