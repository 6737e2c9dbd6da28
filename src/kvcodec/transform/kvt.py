"""The .kvt calibration file: a safetensors file (tensors g<i>.<k|v>.{mean,basis,variances})
whose metadata carries the format name and version, the shape, the rotary settings and the layer
groups. Its identity is the sha256 of its bytes; the codec id and every chunk carry it."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from kvcodec.errors import ConfigError, FormatError
from kvcodec.transform.calibration import KINDS, Calibration, GroupBasis
from kvcodec.transform.rope import RopeSpec

FORMAT = "kvcodec-transform"
VERSION = 2  # 2: optional channel weights (weighted KLT); written as 1 when there are none
READABLE = ("1", "2")
MAX_LAYERS = 1 << 16  # bound on layers, heads and head_dim a .kvt may announce


def kvt_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def to_bytes(cal: Calibration) -> bytes:
    from safetensors.torch import save

    tensors = {}
    for (g, kind), b in sorted(cal.bases.items()):
        for name in ("mean", "basis", "variances", "weights"):
            if getattr(b, name) is not None:
                tensors[f"g{g}.{kind}.{name}"] = getattr(b, name).to(torch.float32).contiguous()
    weighted = any(b.weights is not None for b in cal.bases.values())
    meta = {
        "format": FORMAT,
        "version": str(VERSION if weighted else 1),
        "shape": json.dumps([cal.layers, cal.kv_heads, cal.head_dim]),
        "rope": json.dumps(cal.rope.to_dict() if cal.rope else None),
        "groups": json.dumps([list(g) for g in cal.groups]),
        "info": json.dumps(cal.info, sort_keys=True),
    }
    return save(tensors, metadata=meta)


def save_kvt(cal: Calibration, path: str | Path) -> str:
    """Write `cal` atomically; returns its hash."""
    data = to_bytes(cal)
    write_atomic(Path(path), data)
    return kvt_hash(data)


def write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _meta(data: bytes) -> dict[str, str]:
    if len(data) < 8:
        raise FormatError("not a .kvt transform file (too short)")
    n = int.from_bytes(data[:8], "little")
    try:
        head = json.loads(data[8 : 8 + n])
        return dict(head.get("__metadata__") or {})
    except (ValueError, AttributeError) as e:
        raise FormatError(f"not a .kvt transform file: {e}") from e


def from_bytes(data: bytes) -> Calibration:
    from safetensors.torch import load

    meta = _meta(data)
    if meta.get("format") != FORMAT:
        raise FormatError(f"not a .kvt transform file (format {meta.get('format')!r})")
    if meta.get("version") not in READABLE:
        raise FormatError(
            f".kvt version {meta.get('version')} is not readable (this kvcodec reads {', '.join(READABLE)})"
        )
    try:
        tensors = load(data)
        layers, heads, dim = _shape(json.loads(meta["shape"]))
        rope = json.loads(meta["rope"])
        rope = RopeSpec.from_dict(rope) if rope is not None else None
        groups = tuple(tuple(_index(i) for i in g) for g in json.loads(meta["groups"]))
        info = json.loads(meta.get("info", "{}"))
        if not isinstance(info, dict):
            raise TypeError(f"info is {type(info).__name__}, not an object")
        bases = {
            (g, k): GroupBasis(
                *(tensors[f"g{g}.{k}.{n}"] for n in ("mean", "basis", "variances")), tensors.get(f"g{g}.{k}.weights")
            )
            for g in range(len(groups))
            for k in KINDS
        }
    except (KeyError, ValueError, TypeError, Exception) as e:
        raise FormatError(f"damaged .kvt transform file: {e}") from e
    if sorted(i for g in groups for i in g) != list(range(layers)):
        raise FormatError(".kvt layer groups do not cover the layers exactly once")
    for (g, _), b in bases.items():
        d = len(groups[g]) * heads * dim
        if b.mean.shape != (d,) or b.basis.shape != (d, d) or b.variances.shape != (d,):
            raise FormatError(f".kvt group {g} tensors do not match its {d} dimensions")
        if b.weights is not None and (b.weights.shape != (d,) or not bool((b.weights > 0).all())):
            raise FormatError(f".kvt group {g} channel weights are not {d} positive numbers")
        parts = (b.mean, b.basis, b.variances) + ((b.weights,) if b.weights is not None else ())
        if not all(bool(torch.isfinite(t).all()) for t in parts) or bool((b.variances < 0).any()):
            raise FormatError(f".kvt group {g} holds NaN, infinite or negative-variance values (a damaged file)")
    return Calibration(layers, heads, dim, rope, groups, bases, info)


def _index(i) -> int:
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < MAX_LAYERS:
        raise ValueError(f"layer index {i!r} is not an integer in 0..{MAX_LAYERS - 1}")
    return i


def _shape(shape) -> tuple[int, int, int]:
    if not isinstance(shape, list) or len(shape) != 3:
        raise ValueError(f"shape {shape!r} is not [layers, kv_heads, head_dim]")
    for n in shape:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_LAYERS:
            raise ValueError(f"shape {shape!r} is not three integers in 1..{MAX_LAYERS}")
    return tuple(shape)


def load_kvt(path: str | Path) -> tuple[Calibration, str]:
    """(calibration, sha256 hex) of a .kvt file; ConfigError if missing, FormatError if damaged."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"transform file {path}: {e.strerror or e}") from e
    return from_bytes(data), kvt_hash(data)
