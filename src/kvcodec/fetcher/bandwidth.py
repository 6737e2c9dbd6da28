"""Link bandwidth estimation from the chunks received so far.

Each completed get gives a sample: its bytes over the time it occupied the link. With several gets
in flight, a get is charged only the time since the previous completion (or its own start, if
later), so overlapping transfers are not double counted. Samples are smoothed with an EWMA of
seconds-per-byte (what predicts a transfer's duration; an EWMA of rates would overweight short
bursts), and the EWMA deviation is tracked to report jitter.

Per-request latency (round trip + client overhead) is estimated separately, from requests that
carry almost no payload (the fetcher's batched meta query), and subtracted from each sample:
otherwise small objects look like a slow link, which biases an adaptive policy towards small
objects, whose samples then confirm the bias.
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
        self.latency_s = 0.0
        self._lat_window: list[float] = []
        self._max_bytes = 1
        self._lock = threading.Lock()

    def add_latency(self, seconds: float) -> None:
        """A request that moved (almost) no payload took `seconds`. The latency is the minimum of
        the last 16 such samples (a descheduled thread or a first-call warm-up inflates single
        samples; over-estimating latency would inflate the bandwidth estimate)."""
        if seconds <= 0:
            return
        with self._lock:
            self._lat_window.append(seconds)
            del self._lat_window[:-16]
            self.latency_s = min(self._lat_window)

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
            if start == t_start:  # not overlapped: the request paid its own latency
                # (at most half of it: a latency sample inflated by a busy CPU must not turn a
                # slow transfer into a fast one)
                dt = max(dt - self.latency_s, 0.5 * dt)
            spb = dt / nbytes
            # small transfers say less about the link (overheads dominate): they move it less
            self._max_bytes = max(self._max_bytes, nbytes)
            a = self.alpha * min(1.0, nbytes / self._max_bytes)
            if self.samples == 0:
                self._spb = spb
            else:
                err = spb - self._spb
                self._spb += a * err
                self._dev += a * (abs(err) - self._dev)
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
        """Predicted seconds for a get of `nbytes` (latency + bytes / bandwidth)."""
        return self.latency_s + nbytes * self._spb
