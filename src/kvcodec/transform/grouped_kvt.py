"""A transform for a cache of several layer groups (sliding-window layers, MLA latents and RoPE keys):
one ordinary .kvt per KVSpec group, bundled in one safetensors file.

    metadata: format "kvcodec-transform-grouped", version "1", kvspec (KVSpec.to_dict JSON of the
              model's cache), parts (JSON list of [group name, sha256 of the part]), info (JSON)
    tensors:  part.<i>: uint8, the i-th group's own .kvt bytes (read by kvt.from_bytes, with all its checks)

A part's identity (and the hash every chunk it codes carries) is the sha256 of its own bytes, so a
chunk of one group is refused by another group's transform. The file's sha256 names the whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvcodec.errors import ConfigError, FormatError
from kvcodec.kvspec.spec import KVSpec
from kvcodec.transform.calibration import Calibration
from kvcodec.transform.kvt import _meta, from_bytes, kvt_hash, save_canonical, to_bytes

FORMAT = "kvcodec-transform-grouped"
VERSION = "1"


def is_grouped_kvt(data: bytes) -> bool:
    try:
        return _meta(data).get("format") == FORMAT
    except FormatError:
        return False


def grouped_to_bytes(spec: KVSpec, parts: dict[str, Calibration], info: dict | None = None) -> bytes:
    """parts: group name -> its calibration, for every group of `spec`."""
    names = [g.name for g in spec.groups]
    if sorted(parts) != sorted(names):
        raise ConfigError(f"a grouped transform needs one calibration per group {names}; got {sorted(parts)}")
    blobs = [to_bytes(parts[n]) for n in names]
    tensors = {f"part.{i}": torch.frombuffer(bytearray(b), dtype=torch.uint8) for i, b in enumerate(blobs)}
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "kvspec": json.dumps(spec.to_dict()),
        "parts": json.dumps([[n, kvt_hash(b)] for n, b in zip(names, blobs)]),
        "info": json.dumps(info or {}, sort_keys=True),
    }
    return save_canonical(tensors, meta)


def grouped_from_bytes(data: bytes) -> tuple[KVSpec, dict[str, tuple[Calibration, str]], dict]:
    """(spec, {group name: (calibration, part sha256)}, info); FormatError for a damaged file."""
    from safetensors.torch import load

    meta = _meta(data)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise FormatError(f"not a grouped .kvt of version {VERSION} ({meta.get('format')!r} {meta.get('version')!r})")
    try:
        spec = KVSpec.from_dict(json.loads(meta["kvspec"]))
        listed = json.loads(meta["parts"])
        info = json.loads(meta.get("info", "{}"))
        tensors = load(data)
        if not isinstance(info, dict) or not isinstance(listed, list):
            raise TypeError("info / parts are not an object / a list")
    except (KeyError, ValueError, TypeError, Exception) as e:
        raise FormatError(f"damaged grouped .kvt transform file: {e}") from e
    names = [g.name for g in spec.groups]
    if [p[0] if isinstance(p, list) and len(p) == 2 else None for p in listed] != names:
        raise FormatError(f"grouped .kvt parts {listed!r} do not list the groups {names}")
    out = {}
    for i, (name, digest) in enumerate(listed):
        blob = tensors.get(f"part.{i}")
        if blob is None or blob.dtype != torch.uint8 or blob.dim() != 1:
            raise FormatError(f"grouped .kvt: part {i} ({name}) is missing or not bytes")
        raw = blob.numpy().tobytes()
        if kvt_hash(raw) != digest:
            raise FormatError(f"grouped .kvt: part {i} ({name}) does not match its sha256 (a damaged file)")
        cal = from_bytes(raw)
        g = spec.groups[i]
        if (cal.layers, cal.kv_heads, cal.head_dim) != (len(g.layers), g.heads, g.head_dim):
            raise FormatError(f"grouped .kvt: part {name} is shaped {(cal.layers, cal.kv_heads, cal.head_dim)}")
        out[name] = (cal, digest)
    return spec, out, info


def save_grouped_kvt(spec: KVSpec, parts: dict[str, Calibration], path: str | Path, info: dict | None = None) -> str:
    """Write atomically; returns the file's sha256."""
    from kvcodec.atomic import write_atomic

    data = grouped_to_bytes(spec, parts, info)
    write_atomic(Path(path), data)
    return kvt_hash(data)
