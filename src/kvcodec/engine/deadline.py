"""The default fetch deadline: a fetch may take as long as recomputing its prefix would.

The engine measures its prefill rate (tokens per second of prefill forwards) and gives each fetch
of n tokens n / rate seconds; past that the fetch stops and the rest is recomputed, so reuse is
never slower than not reusing (beyond the deadline itself).
"""

from __future__ import annotations

import threading

MIN_SAMPLE_TOKENS = 16  # shorter prefills are dominated by per-forward overhead


def recompute_seconds(tokens: int, tokens_per_s: float) -> float:
    """Seconds a prefill of `tokens` takes at `tokens_per_s`."""
    if tokens <= 0:
        return 0.0
    if tokens_per_s <= 0:
        raise ValueError("tokens_per_s must be > 0")
    return tokens / tokens_per_s


def ema(previous: float | None, sample: float, alpha: float) -> float:
    """Exponential moving average; the first sample is taken as is."""
    return sample if previous is None else (1 - alpha) * previous + alpha * sample


class PrefillRate:
    """Measured prefill throughput (thread-safe): an EMA over prefill forwards."""

    def __init__(self, alpha: float = 0.3, min_deadline_s: float = 0.05) -> None:
        self.alpha = alpha
        self.min_deadline_s = min_deadline_s
        self.tokens_per_s: float | None = None
        self._lock = threading.Lock()

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < MIN_SAMPLE_TOKENS or seconds <= 0:
            return
        with self._lock:
            self.tokens_per_s = ema(self.tokens_per_s, tokens / seconds, self.alpha)

    def deadline_s(self, tokens: int) -> float | None:
        """Seconds a fetch of `tokens` may take; None before any prefill was measured."""
        with self._lock:
            rate = self.tokens_per_s
        if rate is None:
            return None
        return max(self.min_deadline_s, recompute_seconds(tokens, rate))
