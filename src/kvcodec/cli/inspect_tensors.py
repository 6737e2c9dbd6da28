"""`kvcodec inspect` on the safetensors files kvcodec writes: a .kvt of calibrate (its calibration,
where it was fitted and the quality it measured on held-out texts) and a KV file of extract or
decode (its tensors and model). The containers encode writes are codec_cmds's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcodec.transform.quality import summary

KVT_FORMATS = ("kvcodec-transform", "kvcodec-transform-grouped")
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on its header: beyond it, a text file's bytes, say


def is_safetensors(data: bytes) -> bool:
    """Looks like a safetensors file: an 8-byte little-endian header length, then a JSON object
    (whole or, in a file cut short, its beginning)."""
    n = int.from_bytes(data[:8], "little") if len(data) >= 10 else 0
    return 2 <= n <= MAX_HEADER_BYTES and data[8:9] == b"{"


def describe_tensors(src: Path, data: bytes) -> dict[str, Any]:
    """The summary of a .kvt (transform.describe) or of a KV file (kvspec.files), by the format its
    metadata names; a damaged file is the loaders' FormatError, a foreign one their error."""
    from kvcodec.errors import TruncatedError
    from kvcodec.kvspec.files import describe_kv_file
    from kvcodec.transform import kvt
    from kvcodec.transform.describe import describe_kvt

    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise TruncatedError(
            f"{src}: a safetensors file cut short (its header announces {n} bytes, {len(data) - 8} follow)"
        )
    if kvt._meta(data).get("format") in KVT_FORMATS:
        return describe_kvt(data)
    return describe_kv_file(src)


def tensors_lines(src: Path, info: dict[str, Any]) -> list[str]:
    """What inspect prints for a summary of describe_tensors."""
    if info["format"] == "kv-file":
        return _kv_file_lines(src, info)
    lines = [
        f"file        {src} ({info['file_bytes']:,} bytes, {info['format']} v{info['version']})",
        f"sha256      {info['sha256']} (codec ids and chunks name the .kvt by it)",
    ]
    if "model" in info:
        lines.append(f"model       {info['model']}" + (f" ({info['model_id']})" if info.get("model_id") else ""))
    parts = info.get("parts") or {"": info}
    for name, part in parts.items():
        lines += _calibration_lines(name, part)
    return lines + _fit_lines(info)


def _calibration_lines(name: str, cal: dict[str, Any]) -> list[str]:
    layers, heads, dim = cal["shape"]
    sizes = "/".join(str(n) for n in sorted({len(g) for g in cal["groups"]}))
    rope = cal["rope"]
    rotary = "off (keys fitted as stored)" if rope is None else f"theta {rope['theta']:g} {rope['style']}"
    if rope is not None and rope.get("rotary_dim") not in (None, dim):
        rotary += f", {rope['rotary_dim']} of {dim} dims rotated"
    head = f"part {name}: " if name else ""
    return [
        f"kv          {head}{layers} layers x {heads} kv heads x {dim} dims; layer groups of {sizes} layers "
        f"({len(cal['groups'])})",
        f"rope        {head}{rotary}",
    ]


def _fit_lines(info: dict[str, Any]) -> list[str]:
    weighted = bool(info.get("weighted")) or any(p.get("weighted") for p in (info.get("parts") or {}).values())
    how = f"Fisher-weighted (alpha {info.get('weight_alpha', 1.0):g})" if weighted else "plain MSE"
    sources = ", ".join(info.get("sources") or []) or "not recorded"
    tokens = f" ({info['tokens']:,} tokens)" if isinstance(info.get("tokens"), int) else ""
    lines = [f"fitted on   {sources}{tokens}; {how}"]
    report = info.get("quality") or {}
    if report.get("held_out"):
        fell = info.get("fallback") or []
        safe = info.get("safe_ratio")
        lines += [
            "fallback    "
            + (f"{', '.join(fell)} (coded per channel: their basis lost on held-out data)" if fell else "none"),
            f"held out    {', '.join(report['held_out'])}: {summary(report)}",
            f"safe ratio  {f'{safe:g}x' if safe else 'none of the measured ratios'} (no measurable loss)",
        ]
    else:
        lines.append("held out    nothing: no fallback check and no quality report")
    cost = info.get("calibration_cost") or {}
    if "seconds" in cost:
        where = f" on {cost['device']} ({cost['dtype']})" if "device" in cost else ""
        lines.append(f"cost        {cost['seconds']:g} s{where}, peak RSS {cost.get('peak_rss_mb', '?')} MB")
    return lines


def _kv_file_lines(src: Path, info: dict[str, Any]) -> list[str]:
    tensors = ", ".join(f"{name} {tuple(shape)}" for name, shape in info["tensors"].items())
    lines = [
        f"file        {src} (a KV file: {src.stat().st_size:,} bytes)",
        f"kv          {tensors} {info['dtype']}" + (f", {info['tokens']} tokens" if info["tokens"] is not None else ""),
    ]
    if "model" in info:
        lines.append(f"model       {info['model']}" + (f" ({info['model_id']})" if info.get("model_id") else ""))
    if "text" in info:
        lines.append(f"text        {info['text']}")
    return lines
