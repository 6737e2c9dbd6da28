"""What a model's KV cache holds, layer by layer, and how its layers form uniform groups.

A `KVSpec` lists every attention layer of a model: its kind, the (heads, dim) of what it caches as
"keys" and as "values", and how many recent positions it keeps. `group_layers` puts layers that
cache the same shapes into groups; each group is one canonical `(layers, 2, tokens, heads,
head_dim)` tensor that the chunk codecs already code:

* kind "full": every position is kept. kind "sliding": only the last `keep` positions are (a
  sliding-window layer; transformers' DynamicSlidingWindowLayer keeps `sliding_window - 1`).
  kind "mla": a multi-head latent attention layer caching the compressed latent as "keys" and the
  decoupled RoPE key as "values" (DeepSeek-V2/V3 in transformers 5.x).
* stream "kv": keys and values have the same (heads, dim) and sit on axis 1 (0 = keys, 1 = values),
  as in the plain codec. When they differ (MLA; any layer with different K and V dims) each becomes a
  group of its own, stream "k" or "v": the one tensor's last dim is split in two halves on axis 1
  (`head_dim` = dim / 2), so the codec still sees a pair and the packing is a pure reshape.

Every function here is pure (no transformers, no I/O); the spec serializes to a small JSON dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvcodec.dtypes import DTYPES
from kvcodec.errors import FormatError, ShapeError

SPEC_VERSION = 1
KINDS = ("full", "sliding", "mla")
STREAMS = ("kv", "k", "v")
MLA_STREAM_NAMES = {"k": "latent", "v": "rope"}


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One attention layer's cache: keys (heads, dim), values (heads, dim), positions kept."""

    kind: str
    k_shape: tuple[int, int]
    v_shape: tuple[int, int]
    keep: int | None = None  # sliding: the layer keeps only its last `keep` positions

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ShapeError(f"layer kind {self.kind!r} is not one of {', '.join(KINDS)}")
        for name, shape in (("keys", self.k_shape), ("values", self.v_shape)):
            if len(shape) != 2 or min(shape) < 1:
                raise ShapeError(f"layer {name} shape must be (heads >= 1, dim >= 1); got {shape}")
        if (self.kind == "sliding") != (self.keep is not None):
            raise ShapeError(f"a {self.kind} layer {'needs' if self.kind == 'sliding' else 'takes no'} `keep`")
        if self.keep is not None and self.keep < 1:
            raise ShapeError(f"a sliding layer keeps >= 1 positions; got keep={self.keep}")

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": self.kind, "k": list(self.k_shape), "v": list(self.v_shape)}
        return d | ({"keep": self.keep} if self.keep is not None else {})

    @classmethod
    def from_dict(cls, d: Any) -> LayerSpec:
        try:
            return cls(d["kind"], tuple(int(x) for x in d["k"]), tuple(int(x) for x in d["v"]), d.get("keep"))
        except (KeyError, TypeError, ValueError, AttributeError, ShapeError) as e:
            raise FormatError(f"invalid layer description {d!r}: {e}") from e


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """Layers coded together as one canonical (len(layers), 2, tokens, heads, head_dim) tensor."""

    kind: str
    stream: str
    layers: tuple[int, ...]
    heads: int
    head_dim: int
    keep: int | None = None

    @property
    def name(self) -> str:
        stream = MLA_STREAM_NAMES.get(self.stream, self.stream) if self.kind == "mla" else self.stream
        span = f"{self.kind}{self.keep}" if self.keep is not None else self.kind
        return f"{span}-{stream}-{self.heads}x{self.head_dim}"

    @property
    def stream_dim(self) -> int:
        """The dim of one cached stream: head_dim for "kv", twice it for a halves-packed "k" / "v"."""
        return self.head_dim if self.stream == "kv" else 2 * self.head_dim

    def shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        return (len(self.layers), 2, tokens, self.heads, self.head_dim)

    def held_from(self, stop: int) -> int:
        """First position a cache of `stop` positions holds in this group's layers."""
        return 0 if self.keep is None else max(0, stop - self.keep)


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """A model's KV cache, layer by layer, and the dtype it is stored in."""

    layers: tuple[LayerSpec, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not self.layers:
            raise ShapeError("a KV spec needs at least one layer")
        if self.dtype not in DTYPES:
            raise ShapeError(f"KV dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        object.__setattr__(self, "_groups", group_layers(self.layers))

    @property
    def groups(self) -> tuple[GroupSpec, ...]:
        return self._groups  # type: ignore[attr-defined]

    @property
    def uniform(self) -> bool:
        """True when one plain canonical tensor holds the whole cache (one full "kv" group)."""
        return len(self.groups) == 1 and self.groups[0].kind == "full" and self.groups[0].stream == "kv"

    def to_dict(self) -> dict[str, Any]:
        return {"version": SPEC_VERSION, "dtype": self.dtype, "layers": [layer.to_dict() for layer in self.layers]}

    @classmethod
    def from_dict(cls, d: Any) -> KVSpec:
        if not isinstance(d, dict) or d.get("version") != SPEC_VERSION:
            got = d.get("version") if isinstance(d, dict) else type(d).__name__
            raise FormatError(f"KV spec version {got!r} is not one this build reads ({SPEC_VERSION})")
        layers = d.get("layers")
        if not isinstance(layers, list):
            raise FormatError("KV spec has no layer list")
        try:
            return cls(tuple(LayerSpec.from_dict(x) for x in layers), d.get("dtype"))
        except ShapeError as e:
            raise FormatError(f"invalid KV spec: {e}") from e

    @classmethod
    def uniform_spec(cls, layers: int, kv_heads: int, head_dim: int, dtype: str) -> KVSpec:
        """The spec of a plain (layers, 2, tokens, kv_heads, head_dim) cache."""
        layer = LayerSpec("full", (kv_heads, head_dim), (kv_heads, head_dim))
        return cls((layer,) * layers, dtype)


def _group_keys(index: int, layer: LayerSpec) -> list[tuple[str, tuple[int, int]]]:
    if layer.k_shape == layer.v_shape:
        return [("kv", layer.k_shape)]
    for name, (_, dim) in (("keys", layer.k_shape), ("values", layer.v_shape)):
        if dim % 2:
            raise ShapeError(
                f"layer {index} caches {name} of odd dim {dim} beside differently shaped "
                f"{'values' if name == 'keys' else 'keys'}: unsupported (a K-only or V-only stream "
                "is coded as two halves of its dim)"
            )
    return [("k", layer.k_shape), ("v", layer.v_shape)]


def group_layers(layers: Sequence[LayerSpec]) -> tuple[GroupSpec, ...]:
    """Uniform groups of layers, in order of their first layer (then k before v)."""
    members: dict[tuple, list[int]] = {}
    for i, layer in enumerate(layers):
        for stream, shape in _group_keys(i, layer):
            members.setdefault((layer.kind, layer.keep, stream, shape), []).append(i)
    groups = []
    for (kind, keep, stream, (heads, dim)), idx in members.items():
        head_dim = dim if stream == "kv" else dim // 2
        groups.append(GroupSpec(kind, stream, tuple(idx), heads, head_dim, keep))
    return tuple(groups)
