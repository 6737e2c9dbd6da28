"""The .kvt calibration file: a safetensors file (tensors g<i>.<k|v>.{mean,basis,variances})
whose metadata carries the format name and version, the shape, the rotary settings and the layer
groups. Its identity is the sha256 of its bytes; the codec id and every chunk carry it.

Version 3 stores a basis as float16 when float16 holds it exactly (calibration rounds its bases to
float16: `compact`) and only its leading columns up to the last one with a positive variance (the
coordinates no ratio codes are zeroed at calibration); the reader pads the columns back with zeros
(variance 0: never coded), so codecs and restore paths see the same (d, d) basis as before."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from kvcodec.atomic import write_atomic
from kvcodec.errors import ConfigError, FormatError
from kvcodec.transform.calibration import KINDS, Calibration, GroupBasis
from kvcodec.transform.rope import RopeSpec

FORMAT = "kvcodec-transform"
VERSION = 2  # 2: optional channel weights (weighted KLT); written as 1 when there are none
CUT_VERSION = 3  # 3: float16 and/or column-cut bases (written whenever a basis is stored either way)
READABLE = ("1", "2", "3")
CUT_RATIO = 2.0  # coordinates no ratio from this one up codes are dropped from a calibration (`compact`)
CUT_MARGIN = 16.0  # ... with this margin on the distortion level (a step 4x finer than that ratio's)
MAX_LAYERS = 1 << 16  # bound on layers, heads and head_dim a .kvt may announce
MAX_COLUMN_NORM = 1.01  # float16 rounding of unit columns stays far below
MAX_MEAN = 65504.0  # float16 max: KV means beyond it are damage, not data


def kvt_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def kept_columns(b: GroupBasis) -> int:
    """Leading coordinates of a basis to store: up to the last one with a positive variance or a
    nonzero basis column (the rest are zero: cut, and padded back on reading)."""
    live = (b.variances > 0) | (b.basis != 0).any(0)
    idx = torch.nonzero(live).flatten()
    return int(idx[-1]) + 1 if idx.numel() else 1


def _stored_basis(b: GroupBasis) -> torch.Tensor:
    basis = b.basis.to(torch.float32)[:, : kept_columns(b)].contiguous()
    half = basis.to(torch.float16)
    return half if torch.equal(half.to(torch.float32), basis) else basis


def compact(cal: Calibration, min_ratio: float = CUT_RATIO, margin: float = CUT_MARGIN) -> Calibration:
    """`cal` with its bases rounded to float16 and the coordinates that no ratio >= min_ratio codes
    zeroed (variance below the modelled distortion level of min_ratio / margin): what a version-3
    .kvt stores exactly. The dropped coordinates' total variance goes into info["cut"]."""
    from kvcodec.transform import alloc
    from kvcodec.transform.calibration import all_variances

    var = all_variances(cal).to(torch.float64)
    floor = alloc.water_level(var, 16.0 / min_ratio) / margin
    bases, dropped, kept = {}, 0.0, 0
    for key, b in cal.bases.items():
        live = b.variances.to(torch.float64) > floor
        basis = torch.where(live[None, :], b.basis.to(torch.float32), 0.0).to(torch.float16).to(torch.float32)
        dropped += float(b.variances.to(torch.float64)[~live].sum())
        kept += int(live.sum())
        bases[key] = GroupBasis(b.mean, basis, torch.where(live, b.variances, 0.0), b.weights)
    info = dict(
        cal.info, cut={"min_ratio": min_ratio, "kept": kept, "of": int(var.numel()), "dropped_variance": dropped}
    )
    return dataclasses.replace(cal, bases=bases, info=info)


def save_canonical(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """safetensors bytes whose header lists the metadata in sorted order (safetensors' own writer
    orders it at random), so that the same content always has the same bytes and sha256."""
    from safetensors.torch import save

    data = save(tensors, metadata=metadata)
    n = int.from_bytes(data[:8], "little")
    head = json.loads(data[8 : 8 + n])
    meta = head.pop("__metadata__", None) or {}
    order = sorted(head, key=lambda k: head[k]["data_offsets"][0])
    header = json.dumps(
        {"__metadata__": dict(sorted(meta.items())), **{k: head[k] for k in order}}, separators=(",", ":")
    )
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


def to_bytes(cal: Calibration) -> bytes:
    tensors = {}
    for (g, kind), b in sorted(cal.bases.items()):
        for name in ("mean", "variances", "weights"):
            if getattr(b, name) is not None:
                tensors[f"g{g}.{kind}.{name}"] = getattr(b, name).to(torch.float32).contiguous()
        tensors[f"g{g}.{kind}.basis"] = _stored_basis(b)
    weighted = any(b.weights is not None for b in cal.bases.values())
    cut = any(t.dtype == torch.float16 or t.shape[0] != t.shape[1] for n, t in tensors.items() if n.endswith("basis"))
    meta = {
        "format": FORMAT,
        "version": str(CUT_VERSION if cut else VERSION if weighted else 1),
        "shape": json.dumps([cal.layers, cal.kv_heads, cal.head_dim]),
        "rope": json.dumps(cal.rope.to_dict() if cal.rope else None),
        "groups": json.dumps([list(g) for g in cal.groups]),
        "info": json.dumps(cal.info, sort_keys=True),
    }
    return save_canonical(tensors, meta)


def save_kvt(cal: Calibration, path: str | Path) -> str:
    """Write `cal` atomically; returns its hash."""
    data = to_bytes(cal)
    write_atomic(Path(path), data)
    return kvt_hash(data)


def _meta(data: bytes) -> dict[str, str]:
    if len(data) < 8:
        raise FormatError("not a .kvt transform file (too short)")
    if data[:2] == b"KV" and data[2:4].isalpha():  # every kvcodec container starts so (docs/FORMAT.md)
        raise FormatError(
            f"not a .kvt transform file: it is a kvcodec {data[:4].decode()} object (coded KV), not a calibration"
        )
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise FormatError(
            f"not a .kvt transform file: its header announces {n} bytes, {len(data) - 8} follow (truncated?)"
        )
    try:
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    except (ValueError, AttributeError) as e:
        raise FormatError(f"not a .kvt transform file: {e}") from e
    if not isinstance(meta, dict):
        raise FormatError(f"not a .kvt transform file: its metadata is a {type(meta).__name__}, not an object")
    return meta


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
        bases = {(g, k): _block(tensors, f"g{g}.{k}", meta["version"]) for g in range(len(groups)) for k in KINDS}
    except (KeyError, ValueError, TypeError, Exception) as e:
        raise FormatError(f"damaged .kvt transform file: {e}") from e
    if sorted(i for g in groups for i in g) != list(range(layers)):
        raise FormatError(".kvt layer groups do not cover the layers exactly once")
    for (g, _), b in bases.items():
        d = len(groups[g]) * heads * dim
        if any(t.dtype != torch.float32 for t in (b.mean, b.variances)) or (
            b.weights is not None and b.weights.dtype != torch.float32
        ):
            raise FormatError(f".kvt group {g} tensors are not float32")
        if b.mean.shape != (d,) or b.basis.shape != (d, d) or b.variances.shape != (d,):
            raise FormatError(f".kvt group {g} tensors do not match its {d} dimensions")
        if b.weights is not None and (b.weights.shape != (d,) or not bool((b.weights > 0).all())):
            raise FormatError(f".kvt group {g} channel weights are not {d} positive numbers")
        parts = (b.mean, b.basis, b.variances) + ((b.weights,) if b.weights is not None else ())
        if not all(bool(torch.isfinite(t).all()) for t in parts) or bool((b.variances < 0).any()):
            raise FormatError(f".kvt group {g} holds NaN, infinite or negative-variance values (a damaged file)")
        _check_magnitudes(g, b)
    return Calibration(layers, heads, dim, rope, groups, bases, info)


def _check_magnitudes(g: int, b: GroupBasis) -> None:
    """A calibrated basis has orthonormal columns in the channel-weighted metric (W^1/2 B), and a mean
    within fp16's range; a damaged value (a flipped exponent bit) breaks either and would restore
    KV that overflows, so it is refused here."""
    scale = b.weights.sqrt()[:, None] if b.weights is not None else 1.0
    norm = float((b.basis * scale).norm(dim=0).max())
    if norm > MAX_COLUMN_NORM or float(b.mean.abs().max()) > MAX_MEAN:
        raise FormatError(
            f".kvt group {g}: a basis column of norm {norm:.4g} (at most {MAX_COLUMN_NORM}) or a mean beyond "
            f"{MAX_MEAN:g} (a damaged file)"
        )


def _block(tensors: dict, name: str, version: str) -> GroupBasis:
    """One (group, kind) basis; version 3's float16 and cut columns back to a float32 (d, d) basis
    (the cut columns zero, and their variances must be 0: never coded)."""
    basis, var = tensors[f"{name}.basis"], tensors[f"{name}.variances"]
    if version == str(CUT_VERSION) and basis.dtype in (torch.float16, torch.float32) and basis.dim() == 2:
        d, k = basis.shape
        if not 1 <= k <= d or var.shape != (d,) or bool((var[k:] != 0).any()):
            raise ValueError(f"{name}: a basis of {k} of {d} columns with variances of shape {tuple(var.shape)}")
        basis = torch.cat([basis.to(torch.float32), torch.zeros(d, d - k, dtype=torch.float32)], dim=1)
    if basis.dtype != torch.float32:
        raise ValueError(f"{name}: a version-{version} basis of dtype {basis.dtype}")
    return GroupBasis(tensors[f"{name}.mean"], basis, var, tensors.get(f"{name}.weights"))


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
