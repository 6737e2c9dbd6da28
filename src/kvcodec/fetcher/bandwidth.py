"""Link bandwidth estimation from the chunks received so far.

Each completed get gives a sample: its bytes over the time it occupied the link. With several gets
in flight, a get is charged only the time since the previous completion (or its own start, if
later), so overlapping transfers are not double counted. Samples are smoothed with an EWMA of
seconds-per-byte (what predicts a transfer's duration; an EWMA of rates would overweight short
bursts), and the EWMA deviation is tracked to report jitter.
"""

from __future__ import annotations

import threading


class BandwidthEstimator:
    def __init__(self, initial_gbit: float = 1.0, alpha: float = 0.3) -> None:
        if initial_gbit <= 0 or not 0 < alpha <= 1:
            raise ValueError("initial_gbit must be > 0 and 0 < alpha <= 1")
        self.alpha = alpha
        self._spb = 8.0 / (initial_gbit * 1e9)  # seconds per byte
        self._dev = 0.0
        self._last_end = 0.0
        self.samples = 0
        self._lock = threading.Lock()

    def begin(self) -> None:
        """Start of a new fetch: forget the completion clock (keep the estimate as the prior)."""
        with self._lock:
            self._last_end = 0.0

    def add(self, nbytes: int, t_start: float, t_end: float) -> None:
        if nbytes <= 0:
            return
        with self._lock:
            start = max(t_start, self._last_end)
            self._last_end = max(self._last_end, t_end)
            dt = t_end - start
            if dt <= 1e-7:
                return
            spb = dt / nbytes
            if self.samples == 0:
                self._spb = spb
            else:
                err = spb - self._spb
                self._spb += self.alpha * err
                self._dev += self.alpha * (abs(err) - self._dev)
            self.samples += 1

    @property
    def bytes_per_s(self) -> float:
        return 1.0 / self._spb

    @property
    def gbit(self) -> float:
        return 8.0 / self._spb / 1e9

    @property
    def relative_jitter(self) -> float:
        """EWMA |deviation| of seconds-per-byte, relative to its mean."""
        return self._dev / self._spb

    def transfer_s(self, nbytes: int) -> float:
        return nbytes * self._spb
