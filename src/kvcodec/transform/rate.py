"""Measured rate of quantized coefficients: per-coordinate order-0 entropy, and the distortion
level that meets a byte budget on the actual data."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from kvcodec.errors import ConfigError

ESCAPE_BITS = 64.0  # an escape costs its index and its value
# The finest distortion level a size search tries, relative to the largest coefficient variance. At 1e-7
# SmolLM2's default .kvt coded no more than 3.5-3.7x (a 3x target gave 3.47x, every text at that floor);
# 1e-9 reaches ~1.2x.
MIN_LEVEL = 1e-9


def column_entropy_bits(q: torch.Tensor) -> float:
    """Total order-0 bits of integer columns q (tokens, coords), each column its own model,
    values outside [-128, 127] counted as escapes. Each column's bins span only its own values
    (one bincount over the columns' ranges laid end to end); on the CPU in NumPy (its bincount
    ran 3x faster than torch's)."""
    t, c = q.shape
    if q.numel() == 0:
        return 0.0
    if q.device.type == "cpu":
        return _entropy_numpy(q.numpy() if q.dtype == torch.int32 else q.to(torch.int32).numpy())
    return _entropy_torch(q)


def _entropy_torch(q: torch.Tensor) -> float:
    """column_entropy_bits on q's device."""
    t = q.shape[0]
    lo, hi = (int(x) for x in torch.aminmax(q))
    escapes = 0 if lo >= -128 and hi <= 127 else int(((q < -128) | (q > 127)).sum())
    q = q.to(torch.int32) if escapes == 0 else q.clamp(-128, 127).to(torch.int32)
    col_lo, col_hi = torch.aminmax(q, dim=0)
    width = col_hi - col_lo + 1
    base = torch.cumsum(width, 0) - width - col_lo  # bin of value v in column j: base[j] + v
    counts = torch.bincount((q + base).reshape(-1), minlength=int(width.sum())).to(torch.float64)
    # summed over columns: -sum n log2(n / t) = N log2 t - sum n log2 n
    return q.numel() * math.log2(t) - float(torch.xlogy(counts, counts).sum()) / math.log(2) + ESCAPE_BITS * escapes


def _entropy_numpy(q: np.ndarray) -> float:
    """column_entropy_bits of an int32 array."""
    col_lo, col_hi = q.min(axis=0), q.max(axis=0)
    escapes = 0
    if col_lo.min() < -128 or col_hi.max() > 127:
        escapes = int(np.count_nonzero((q < -128) | (q > 127)))
        q, col_lo, col_hi = (np.clip(a, -128, 127) for a in (q, col_lo, col_hi))
    width = col_hi.astype(np.int64) - col_lo + 1
    base = (np.cumsum(width) - width - col_lo).astype(np.int32)  # bin of value v in column j: base[j] + v
    counts = np.bincount((q + base).reshape(-1), minlength=int(width.sum()))
    n = np.arange(q.shape[0] + 1, dtype=np.float64)  # a count is at most the column's length
    n_log_n = n * np.log2(np.maximum(n, 1.0))  # looked up: fewer logarithms than bins
    return q.size * math.log2(q.shape[0]) - float(n_log_n[counts].sum()) + ESCAPE_BITS * escapes


# A level measured to meet a target ratio snaps to this grid (2^(k / LEVELS_PER_OCTAVE)). Every
# prefix's level is measured on its own KV: without the grid each would have a level of its own,
# and a restorer would build a new decode plan for each prefix it fetches. Essays' levels at one
# target spread over ~0.4 octave (Qwen2.5, 512-2048 tokens), a few grid levels; the grid moves a
# level by 1/16 octave at most, which moved Qwen2.5's ratios by 0.80-0.85% (5x) and 1.35-1.49% (8x)
# (benchmarks/results/level-grid-cpu-s65-qwen.md; it depends on the data).
LEVELS_PER_OCTAVE = 8


def on_grid(theta: float) -> float:
    """The grid level (LEVELS_PER_OCTAVE per octave) nearest to theta in log scale. Pure."""
    if not theta > 0 or not math.isfinite(theta):
        raise ConfigError(f"distortion level must be a positive number; got {theta}")
    return 2.0 ** (round(math.log2(theta) * LEVELS_PER_OCTAVE) / LEVELS_PER_OCTAVE)


class LevelSearch:
    """The smallest distortion level theta in [lo, hi] whose size_bits(theta) (decreasing in theta)
    is at most a target, in a few evaluations: every size measured is remembered, so a second
    search (a corrected target) starts from the first one's points. A search ends at a size in
    [target (1 - rtol), target], or at a bracket narrower than XTOL in log theta; at lo when
    size_bits(lo) is small enough, at hi when no level is. Secant steps on the relative size error
    (about linear in log theta), overshooting to bracket the answer, then ITP (_itp)."""

    def __init__(self, size_bits: Callable[[float], float], lo: float, hi: float):
        if not 0 < lo < hi:
            raise ConfigError(f"level search needs 0 < lo < hi; got {lo}, {hi}")
        self.size_bits, self.lo, self.hi = size_bits, math.log(lo), math.log(hi)
        self.sizes: dict[float, float] = {}  # log theta -> size_bits
        self.evals = 0

    def size(self, x: float) -> float:
        if x not in self.sizes:
            self.sizes[x] = float(self.size_bits(math.exp(x)))
            self.evals += 1
        return self.sizes[x]

    def solve(self, target_bits: float, guess: float, rtol: float = 1e-3) -> float:
        if not target_bits > 0:
            raise ConfigError(f"size target must be > 0 bits; got {target_bits}")

        def err(x: float) -> float:  # > 0: too big; in [-rtol, 0]: found
            return self.size(x) / target_bits - 1.0

        known = sorted((x, err(x)) for x in self.sizes)
        above, below = [p for p in known if p[1] > 0], [p for p in known if p[1] <= 0]
        if above and below and below[0][0] > above[-1][0]:  # a bracket already measured
            return math.exp(_itp(err, *above[-1], *below[0], rtol))
        if known:  # the nearest to the target, and the slope of the two nearest
            near = sorted(known, key=lambda p: abs(p[1]))[:2]
            x, e = near[0]
            slope = _slope(*near[0], *near[1]) if len(near) == 2 else DEFAULT_SLOPE
        else:
            x = min(max(math.log(guess), self.lo), self.hi)
            e, slope = err(x), DEFAULT_SLOPE
        return math.exp(self._secant(err, x, e, slope, rtol))

    def _secant(self, err, x: float, e: float, slope: float, rtol: float) -> float:
        """Overshooting secant steps from (x, e) until the target is met or bracketed."""
        over = OVERSHOOT
        for _ in range(MAX_EVALS):
            if -rtol <= e <= 0 or (e > 0 and x >= self.hi) or (e <= 0 and x <= self.lo):
                return x
            dx = -e / slope * over
            dx = math.copysign(min(max(abs(dx), MIN_STEP), MAX_STEP), 1.0 if e > 0 else -1.0)
            nx = min(max(x + dx, self.lo), self.hi)
            ne = err(nx)
            if (ne > 0) != (e > 0):
                return _itp(err, *((x, e, nx, ne) if e > 0 else (nx, ne, x, e)), rtol)
            slope, over = _slope(x, e, nx, ne), over * 2  # not bracketed: overshoot more
            x, e = nx, ne
        return x


DEFAULT_SLOPE = -0.25  # relative size change per unit of log theta (SmolLM2 near 5x: -0.2)
OVERSHOOT = 1.25  # a secant step goes this much further than the line predicts, to bracket the answer
MIN_STEP, MAX_STEP = 0.01, 4.0  # log theta
XTOL = 1e-4  # log theta: a bracket this narrow is solved (about 0.01% of a size)
MAX_EVALS = 40


def _slope(x0: float, e0: float, x1: float, e1: float) -> float:
    """The secant slope of the relative error (negative), DEFAULT_SLOPE where it is not."""
    s = (e1 - e0) / (x1 - x0) if x1 != x0 else 0.0
    return s if s < 0 and math.isfinite(s) else DEFAULT_SLOPE


def _itp(err, a: float, ea: float, b: float, eb: float, rtol: float) -> float:
    """The log level b found on [a, b], err(a) > 0 >= err(b): regula falsi (Illinois: a side kept
    twice has its error halved) projected as ITP does (Oliveira and Takahashi, 2020) into a ball
    around the bracket's middle that shrinks with the evaluations left, so a smooth size converges
    as by interpolation and a size that jumps (where regula falsi crawls toward the jump) within
    ITP_SLACK evaluations of bisection's count."""
    wa, wb, side = ea, eb, 0  # the errors the next point is interpolated from
    budget = max(0, math.ceil(math.log2((b - a) / XTOL))) + ITP_SLACK
    for left in range(budget, -1, -1):
        if b - a < XTOL or eb >= -rtol:
            return b
        mid, x = 0.5 * (a + b), b - wb * (b - a) / (wb - wa)
        r = XTOL / 2 * 2.0**left - (b - a) / 2  # how far from the middle a point may be, the bound kept
        x = min(max(x, mid - r), mid + r, b - 1e-3 * XTOL)
        x = max(x, a + 1e-3 * XTOL)  # strictly inside
        e = err(x)
        if e > 0:
            a, ea, wa, wb, side = x, e, e, (wb / 2 if side == 1 else wb), 1
        else:
            b, eb, wb, wa, side = x, e, e, (wa / 2 if side == -1 else wa), -1
    return b


ITP_SLACK = 3  # evaluations the bracket stage may take beyond bisection's, for interpolation to pay off
