"""What a .kvt holds, for `kvcodec inspect`: `describe_kvt(data)` reads it with the loader's own
checks (a damaged file is a FormatError here as at encode) and summarizes it: format and version,
sha256 (the identity codec ids and chunks carry), the KV shape and layer groups, the rotary
settings, how it was weighted and fitted, its per-channel fallbacks and the quality its
calibration measured on held-out texts, with the safe ratio. A grouped .kvt (one calibration per
layer group of a KVSpec) gives the same per part."""

from __future__ import annotations

from typing import Any

from kvcodec.transform import grouped_kvt, kvt
from kvcodec.transform.calibration import Calibration
from kvcodec.transform.quality import safe_ratio

INFO_FIELDS = ("model", "model_id", "sources", "tokens", "held_out_tokens", "weights", "weight_alpha", "fallback")


def describe_kvt(data: bytes) -> dict[str, Any]:
    """The summary of a .kvt (module docstring); FormatError for data that is no .kvt or a damaged one."""
    if grouped_kvt.is_grouped_kvt(data):
        spec, parts, info = grouped_kvt.grouped_from_bytes(data)
        described = {name: {**calibration_fields(cal), "sha256": digest} for name, (cal, digest) in parts.items()}
        return {**_head(data, grouped_kvt.FORMAT), "kvspec": spec.to_dict(), "parts": described, **info_fields(info)}
    cal = kvt.from_bytes(data)
    return {**_head(data, kvt.FORMAT), **calibration_fields(cal), **info_fields(cal.info)}


def _head(data: bytes, name: str) -> dict[str, Any]:
    """Called once a loader has read the file (its version is one the loader reads)."""
    version = int(kvt._meta(data)["version"])
    return {"format": name, "version": version, "sha256": kvt.kvt_hash(data), "file_bytes": len(data)}


def calibration_fields(cal: Calibration) -> dict[str, Any]:
    """One calibration's shape, layer groups, rotary settings and whether its bases are channel-weighted."""
    return {
        "shape": [cal.layers, cal.kv_heads, cal.head_dim],
        "groups": [list(g) for g in cal.groups],
        "rope": cal.rope.to_dict() if cal.rope is not None else None,
        "weighted": any(b.weights is not None for b in cal.bases.values()),
    }


def info_fields(info: dict[str, Any]) -> dict[str, Any]:
    """What calibration recorded (INFO_FIELDS where present), its quality report, the safe ratio
    that report gives and what calibrating cost."""
    report = info.get("quality")
    return {
        **{k: info[k] for k in INFO_FIELDS if k in info},
        "quality": report,
        "safe_ratio": safe_ratio(report),
        "calibration_cost": info.get("calibration_cost"),
    }
