"""Bandwidth traces: a link's rate as a function of time (piecewise constant, repeating).

A trace is a list of (duration_s, rate_gbit) segments played in a loop. It drives both the
in-process token bucket (kvbench.net.throttle) and the tc-shaped veth link (kvbench.net.netns).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from kvcodec.errors import ConfigError


@dataclass(frozen=True)
class JitterTrace:
    segments: tuple[tuple[float, float], ...]  # (duration_s, rate_gbit)
    name: str = "trace"

    def __post_init__(self) -> None:
        if not self.segments:
            raise ConfigError("a trace needs at least one segment")
        for d, r in self.segments:
            if not (0 < d < math.inf and 0 < r < math.inf):  # a nan rate: a link that never delivers
                raise ConfigError(f"trace segment ({d}, {r}): duration and rate must be finite and > 0")

    @property
    def period_s(self) -> float:
        return sum(d for d, _ in self.segments)

    @property
    def mean_gbit(self) -> float:
        """Time-averaged rate."""
        return sum(d * r for d, r in self.segments) / self.period_s

    def rate_at(self, t: float) -> float:
        t = t % self.period_s
        for d, r in self.segments:
            if t < d:
                return r
            t -= d
        return self.segments[-1][1]

    def transfer_end(self, start_t: float, nbytes: int) -> float:
        """Trace time at which `nbytes` sent from `start_t` have fully passed."""
        bits = nbytes * 8.0
        t = start_t
        # position within the period
        period = self.period_s
        base = math.floor(t / period) * period
        off = t - base
        idx = 0
        while off >= self.segments[idx][0]:
            off -= self.segments[idx][0]
            idx = (idx + 1) % len(self.segments)
        while True:
            d, r = self.segments[idx]
            left = d - off
            cap = left * r * 1e9
            if bits <= cap:
                return t + bits / (r * 1e9)
            bits -= cap
            t += left
            off = 0.0
            idx = (idx + 1) % len(self.segments)

    @classmethod
    def constant(cls, rate_gbit: float) -> JitterTrace:
        return cls(((1.0, float(rate_gbit)),), name=f"const-{rate_gbit:g}gbit")

    @classmethod
    def random_walk(
        cls, mean_gbit: float, *, cv: float = 0.5, segment_s: float = 0.02, n: int = 200, seed: int = 0
    ) -> JitterTrace:
        """Log-normal rates (coefficient of variation `cv`) around `mean_gbit`, each lasting
        `segment_s`, rescaled so the time-average is exactly `mean_gbit`."""
        rng = random.Random(seed)
        sigma = math.sqrt(math.log(1 + cv * cv))
        raw = [math.exp(rng.gauss(-sigma * sigma / 2, sigma)) for _ in range(n)]
        scale = mean_gbit / (sum(raw) / n)
        segs = tuple((segment_s, max(1e-3, x * scale)) for x in raw)
        return cls(segs, name=f"lognormal-mean{mean_gbit:g}gbit-cv{cv:g}-{segment_s * 1e3:g}ms-seed{seed}")

    def to_json(self) -> dict:
        return {"name": self.name, "segments": [list(s) for s in self.segments]}

    @classmethod
    def from_json(cls, d: dict) -> JitterTrace:
        return cls(tuple((float(a), float(b)) for a, b in d["segments"]), name=d.get("name", "trace"))

    @classmethod
    def load(cls, path: str | Path) -> JitterTrace:
        return cls.from_json(json.loads(Path(path).read_text()))
