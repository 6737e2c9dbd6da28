"""GroupedKV: a KV cache as one canonical tensor per layer group, with the positions each holds.

Positions are absolute token positions of the prefix. Every group ends at the same `stop` and
holds a suffix `[starts[g], stop)` of it: a full-attention group usually from 0, a sliding-window
group only its window. `view(start, stop)` gives the part of a range (a chunk) without copying,
`prefix(n)` the part a cache of n positions needs.

`pack_groups` / `unpack_groups` are the pure bijection between per-layer (keys, values) tensors,
each (tokens, heads, dim), and the group tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvcodec.dtypes import DTYPE_NAMES, DTYPES
from kvcodec.errors import ShapeError
from kvcodec.kvspec.spec import GroupSpec, KVSpec

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""One layer's (keys, values), each (tokens, heads, dim)."""


def _halves(x: torch.Tensor) -> torch.Tensor:
    """(tokens, heads, dim) -> (2, tokens, heads, dim / 2): first half, second half."""
    d = x.shape[-1] // 2
    return torch.stack([x[..., :d], x[..., d:]])


def _layer_part(group: GroupSpec, kv: LayerKV) -> torch.Tensor:
    k, v = kv
    if group.stream == "kv":
        return torch.stack([k, v])
    return _halves(k if group.stream == "k" else v)


def pack_groups(spec: KVSpec, pairs: Sequence[LayerKV]) -> tuple[torch.Tensor, ...]:
    """Per-layer (keys, values) -> one (len(layers), 2, tokens, heads, head_dim) tensor per group."""
    if len(pairs) != len(spec.layers):
        raise ShapeError(f"{len(pairs)} layers of KV for a spec of {len(spec.layers)} layers")
    out = []
    for g in spec.groups:
        parts = [_layer_part(g, pairs[i]) for i in g.layers]
        tokens = {p.shape[1] for p in parts}
        if len(tokens) != 1:
            raise ShapeError(
                f"layers {g.layers} of group {g.name} hold different numbers of positions: {sorted(tokens)}"
            )
        out.append(torch.stack(parts))
    return tuple(out)


def unpack_groups(spec: KVSpec, tensors: Sequence[torch.Tensor]) -> list[LayerKV]:
    """The inverse of pack_groups: per-layer (keys, values), views of the group tensors where possible."""
    keys: list[torch.Tensor | None] = [None] * len(spec.layers)
    values: list[torch.Tensor | None] = [None] * len(spec.layers)
    for g, t in zip(spec.groups, tensors, strict=True):
        for j, i in enumerate(g.layers):
            if g.stream == "kv":
                keys[i], values[i] = t[j, 0], t[j, 1]
            elif g.stream == "k":
                keys[i] = torch.cat([t[j, 0], t[j, 1]], dim=-1)
            else:
                values[i] = torch.cat([t[j, 0], t[j, 1]], dim=-1)
    return list(zip(keys, values))  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, eq=False)
class GroupedKV:
    """A KV cache (one sequence) as group tensors; group g holds positions [starts[g], stop)."""

    spec: KVSpec
    stop: int
    starts: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        groups = self.spec.groups
        if len(self.starts) != len(groups) or len(self.tensors) != len(groups):
            raise ShapeError(f"{len(self.tensors)} tensors / {len(self.starts)} starts for {len(groups)} groups")
        dtype = DTYPES[self.spec.dtype]
        for g, s, t in zip(groups, self.starts, self.tensors):
            if not 0 <= s <= self.stop:
                raise ShapeError(f"group {g.name} starts at {s}, outside [0, {self.stop}]")
            if tuple(t.shape) != g.shape(self.stop - s):
                raise ShapeError(f"group {g.name}: tensor {tuple(t.shape)}, expected {g.shape(self.stop - s)}")
            if t.dtype != dtype:
                raise ShapeError(f"group {g.name}: dtype {t.dtype}, the spec says {self.spec.dtype}")

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def empty(
        cls, spec: KVSpec, stop: int, *, start: int = 0, device: str | torch.device = "cpu", window: bool = True
    ) -> GroupedKV:
        """Uninitialized storage for positions [start, stop); with `window`, sliding groups hold only
        the positions a cache of `stop` positions keeps."""
        starts = tuple(min(stop, max(start, g.held_from(stop) if window else 0)) for g in spec.groups)
        dtype = DTYPES[spec.dtype]
        tensors = tuple(torch.empty(g.shape(stop - s), dtype=dtype, device=device) for g, s in zip(spec.groups, starts))
        return cls(spec, stop, starts, tensors)

    @classmethod
    def from_tensor(cls, kv: torch.Tensor, start: int = 0) -> GroupedKV:
        """A plain canonical (layers, 2, tokens, kv_heads, head_dim) tensor holding [start, start + tokens)."""
        if kv.dim() != 5 or kv.shape[1] != 2 or kv.dtype not in DTYPE_NAMES:
            raise ShapeError(
                f"expected a (layers, 2, tokens, kv_heads, head_dim) float tensor; got {tuple(kv.shape)} {kv.dtype}"
            )
        spec = KVSpec.uniform_spec(kv.shape[0], kv.shape[3], kv.shape[4], DTYPE_NAMES[kv.dtype])
        return cls(spec, start + kv.shape[2], (start,), (kv,))

    @classmethod
    def from_layers(cls, spec: KVSpec, stop: int, pairs: Sequence[LayerKV]) -> GroupedKV:
        """Per-layer (keys, values), each holding the last positions before `stop`."""
        tensors = pack_groups(spec, pairs)
        return cls(spec, stop, tuple(stop - t.shape[2] for t in tensors), tensors)

    # ---- views -----------------------------------------------------------------------------------
    def view(self, start: int, stop: int) -> GroupedKV:
        """The positions [start, stop) of every group (what of them it holds), sharing storage."""
        if not 0 <= start <= stop <= self.stop:
            raise ShapeError(f"positions [{start}, {stop}) are not inside [0, {self.stop})")
        starts = tuple(min(max(s, start), stop) for s in self.starts)
        tensors = tuple(t[:, :, a - s : stop - s] for t, s, a in zip(self.tensors, self.starts, starts))
        return GroupedKV(self.spec, stop, starts, tensors)

    def prefix(self, tokens: int) -> GroupedKV:
        """What a cache of the first `tokens` positions holds (sliding groups: their window);
        ShapeError when a group lacks positions it needs."""
        if not 0 < tokens <= self.stop:
            raise ShapeError(f"a prefix of {tokens} tokens is not inside the {self.stop} held")
        for g, s in zip(self.spec.groups, self.starts):
            if s > g.held_from(tokens):
                raise ShapeError(
                    f"group {g.name} holds positions from {s}; a prefix of {tokens} tokens needs them from "
                    f"{g.held_from(tokens)}"
                )
        v = self.view(0, tokens)
        starts = tuple(g.held_from(tokens) for g in self.spec.groups)
        tensors = tuple(t[:, :, a - s :] for t, s, a in zip(v.tensors, v.starts, starts))
        return GroupedKV(self.spec, tokens, starts, tensors)

    def layers(self) -> list[tuple[int, LayerKV]]:
        """(first position held, (keys, values)) per layer."""
        first = {i: s for g, s in zip(self.spec.groups, self.starts) for i in g.layers}
        return [(first[i], kv) for i, kv in enumerate(unpack_groups(self.spec, self.tensors))]

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> GroupedKV:
        spec = self.spec if dtype is None else dataclasses.replace(self.spec, dtype=DTYPE_NAMES[dtype])
        return GroupedKV(spec, self.stop, self.starts, tuple(t.to(device=device, dtype=dtype) for t in self.tensors))

    def equal(self, other: GroupedKV) -> bool:
        """Same spec, positions and bits (NaN payloads included)."""
        return (
            self.spec == other.spec
            and self.stop == other.stop
            and self.starts == other.starts
            and all(_bits_equal(a, b) for a, b in zip(self.tensors, other.tensors))
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(ints).cpu(), b.contiguous().view(ints).cpu()))
