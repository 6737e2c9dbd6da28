"""Resolution policies: which of a chunk's stored resolutions to fetch.

The fetch pipeline asks `policy.choose(ctx)` once per chunk, just before the chunk's network get,
with a `ChoiceContext` holding the chunk's blob size and predicted decode time per resolution, the
current bandwidth estimate, the decode stage's predicted backlog and the remaining chunks.

- ``adaptive``: the resolution that minimises the predicted finish time of the whole pipeline
  (this chunk, then the remaining ones at the best single resolution), re-decided per chunk as
  the bandwidth estimate and backlog change; so it trades bytes for decode speed where it pays.
- ``fixed:J`` or ``fixed:WxH``: always resolution J (index) / WxH.
- ``min-bytes`` / ``min-decode``: the smallest blob / the fastest predicted decode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

from kvcodec.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ChoiceContext:
    sizes: Sequence[int]  # this chunk's blob bytes per resolution
    decode_s: Sequence[float]  # predicted decode seconds per resolution
    bytes_per_s: float  # bandwidth estimate
    backlog_s: float  # predicted decode work queued ahead of this chunk (seconds, one worker)
    decode_workers: int
    remaining: int  # chunks after this one
    rest_sizes: Sequence[float]  # mean blob bytes per resolution over the remaining chunks
    rest_decode_s: Sequence[float]  # mean predicted decode seconds per resolution, remaining
    latency_s: float = 0.0  # per-request latency of a get (paid once per chunk)


class ResolutionPolicy(Protocol):
    name: str

    def choose(self, ctx: ChoiceContext) -> int: ...


class FixedPolicy:
    def __init__(self, index: int) -> None:
        self.index = index
        self.name = f"fixed:{index}"

    def choose(self, ctx: ChoiceContext) -> int:
        if not 0 <= self.index < len(ctx.sizes):
            raise ConfigError(f"{self.name}: chunk has {len(ctx.sizes)} resolutions")
        return self.index


class MinBytesPolicy:
    name = "min-bytes"

    def choose(self, ctx: ChoiceContext) -> int:
        return min(range(len(ctx.sizes)), key=lambda j: ctx.sizes[j])


class MinDecodePolicy:
    name = "min-decode"

    def choose(self, ctx: ChoiceContext) -> int:
        return min(range(len(ctx.sizes)), key=lambda j: (ctx.decode_s[j], ctx.sizes[j]))


def predicted_finish(ctx: ChoiceContext, j: int) -> float:
    """Predicted seconds from now until the pipeline finishes if this chunk uses resolution j and
    the remaining chunks the best single resolution (network: one serial link; decode: a pool of
    `decode_workers` fed in arrival order)."""
    w = max(1, ctx.decode_workers)
    net = ctx.latency_s + ctx.sizes[j] / ctx.bytes_per_s
    dec = max(net, ctx.backlog_s / w) + ctx.decode_s[j]
    if ctx.remaining <= 0:
        return dec
    best = float("inf")
    for k in range(len(ctx.rest_sizes)):
        n_rest = ctx.latency_s + ctx.rest_sizes[k] / ctx.bytes_per_s
        net_end = net + ctx.remaining * n_rest
        dec_end = max(dec + ctx.remaining * ctx.rest_decode_s[k] / w, net_end + ctx.rest_decode_s[k])
        best = min(best, dec_end)
    return best


class AdaptivePolicy:
    name = "adaptive"

    def choose(self, ctx: ChoiceContext) -> int:
        return min(range(len(ctx.sizes)), key=lambda j: (predicted_finish(ctx, j), ctx.sizes[j]))


_POLICIES: dict[str, Callable[[str], ResolutionPolicy]] = {
    "adaptive": lambda arg: AdaptivePolicy(),
    "min-bytes": lambda arg: MinBytesPolicy(),
    "min-decode": lambda arg: MinDecodePolicy(),
}


def register_policy(name: str, factory: Callable[[str], ResolutionPolicy]) -> None:
    _POLICIES[name] = factory


def get_policy(spec: str | ResolutionPolicy, resolutions: Sequence[tuple[int, int]] = ()) -> ResolutionPolicy:
    """A policy from its name: "adaptive", "min-bytes", "min-decode", "fixed:J" or "fixed:WxH". Where the
    codec's `resolutions` are given, a fixed policy must name one of them (ConfigError)."""
    if not isinstance(spec, str):
        return spec
    name, _, arg = spec.partition(":")
    if name == "fixed":
        return FixedPolicy(_fixed_index(spec, arg, [tuple(r) for r in resolutions]))
    if name not in _POLICIES:
        raise ConfigError(f"unknown policy {spec!r}; known: {sorted(_POLICIES) + ['fixed:J', 'fixed:WxH']}")
    return _POLICIES[name](arg)


def _fixed_index(spec: str, arg: str, resolutions: list[tuple]) -> int:
    """The resolution index a "fixed:J" or "fixed:WxH" policy names, checked against `resolutions` where given."""
    try:
        if "x" in arg:
            w, h = (int(v) for v in arg.split("x"))
        else:
            index = int(arg)
    except ValueError:
        raise ConfigError(f"policy {spec!r}: expected fixed:INDEX or fixed:WxH") from None
    if "x" in arg:
        if (w, h) not in resolutions:
            raise ConfigError(f"policy {spec!r}: {w}x{h} is not among the codec's frame sizes {resolutions}")
        return resolutions.index((w, h))
    if index < 0 or (resolutions and index >= len(resolutions)):
        raise ConfigError(f"policy {spec!r}: not an index of the codec's frame sizes {resolutions}")
    return index
