"""The quality a .kvt promises, per ratio, as calibration measured it on held-out texts, and the
choices made from it (`--target-quality`, the safe ratio behind `--target-ratio` warnings).

A report is the .kvt's info["quality"]: {"metric": "model" | "kv", "held_out": [...], "tokens": n,
"points": [{"target": R, "ratio": r, "top1": a, "ppl_delta_pct": p} | {..., "rel_error": e}, ...]}.
With the model, top-1 agreement and perplexity change of teacher-forced continuations on the
restored vs the original KV; from KV files alone, the relative squared error of the restored KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcodec.errors import ConfigError

REPORT_RATIOS = (3.0, 4.0, 5.0, 6.0, 8.0, 10.0)
SAFE_TOP1, SAFE_PPL_PCT = 0.99, 0.5  # "safe": no measurable loss (docs/TRANSFORM.md targets)
SAFE_REL_ERROR = 0.02  # from KV files alone (no model): a heuristic bound, see docs/TRANSFORM.md
METRICS = {"top1": ">=", "ppl": "<=", "err": "<="}


def parse_target(text: str) -> tuple[str, float]:
    """'0.99' or 'top1=0.99' (top-1 agreement at least), 'ppl=0.5' (perplexity change at most, in
    percent), 'err=0.01' (relative KV error at most)."""
    name, _, value = text.rpartition("=")
    name = (name or "top1").strip().lower().removesuffix(">").removesuffix("<")
    try:
        bound = float(value)
    except ValueError:
        bound = float("nan")
    if name not in METRICS or bound != bound:
        raise ConfigError(f"--target-quality {text!r}: give top1=A (e.g. 0.99), ppl=P (percent) or err=E")
    return name, bound


def _value(point: dict[str, Any], metric: str) -> float | None:
    key = {"top1": "top1", "ppl": "ppl_delta_pct", "err": "rel_error"}[metric]
    v = point.get(key)
    return None if v is None else float(v)


def meets(point: dict[str, Any], metric: str, bound: float) -> bool:
    v = _value(point, metric)
    return v is not None and (v >= bound if METRICS[metric] == ">=" else v <= bound)


def ratio_for(report: dict[str, Any] | None, target: str) -> float:
    """The highest measured target ratio whose held-out quality met `target`, as every lower one did;
    ConfigError when the .kvt has no report for that metric or the lowest ratio did not meet it."""
    metric, bound = parse_target(target)
    points = _points(report)
    usable = [p for p in points if _value(p, metric) is not None]
    if not usable:
        have = "a model's" if any("top1" in p for p in points) else "a KV-file" if points else "no"
        raise ConfigError(f"the .kvt has {have} quality report: it cannot pick a ratio for {metric}")
    highest = highest_passing(usable, lambda p: meets(p, metric, bound))
    if highest is None:
        best = max(usable, key=lambda p: _value(p, metric) * (1 if METRICS[metric] == ">=" else -1))
        raise ConfigError(
            f"no calibrated ratio met {metric} {METRICS[metric]} {bound:g} on the held-out texts (best: "
            f"{_value(best, metric):g} at {best['target']:g}x); use a lower --target-ratio or the int8 codec"
        )
    return highest


def safe_ratio(report: dict[str, Any] | None) -> float | None:
    """The highest measured ratio below which every measured ratio had no measurable loss (None: no
    report, or the lowest ratio already lost)."""
    return highest_passing(
        _points(report),
        lambda p: (meets(p, "top1", SAFE_TOP1) and meets(p, "ppl", SAFE_PPL_PCT)) or meets(p, "err", SAFE_REL_ERROR),
    )


def highest_passing(points: Sequence[dict[str, Any]], passes) -> float | None:  # noqa: ANN001 - point -> bool
    """The highest target ratio of the run of passing points from the lowest ratio up: a ratio above
    one that failed, or that did not reach half its target (_reached), is not trusted even where its
    own held-out texts happened to pass (quality falls with the ratio; one flipped token more or less
    decides a point)."""
    best = None
    for p in sorted(points, key=lambda p: float(p["target"])):
        if not (passes(p) and _reached(p)):
            break
        best = float(p["target"])
    return best


def _reached(point: dict[str, Any]) -> bool:
    """Whether a point measured its target ratio: one whose held-out KV coded to under half of it (a few
    tokens, stored nearly whole) says nothing of that ratio's quality."""
    ratio = point.get("ratio")
    return not isinstance(ratio, (int, float)) or ratio >= 0.5 * float(point["target"])


def ratio_warning(report: dict[str, Any] | None, ratio: float) -> str | None:
    """A warning when `ratio` is beyond the measured safe ratio (None when it is not, or nothing was measured)."""
    if not _points(report):
        return None
    safe = safe_ratio(report)
    if safe is not None and ratio <= safe * 1.001:
        return None
    where = f"is beyond the measured safe ratio {safe:g}x" if safe else "was asked, and no measured ratio was loss-free"
    return f"warning: --target-ratio {ratio:g} {where} ({summary(report)})"


def _points(report: dict[str, Any] | None) -> Sequence[dict[str, Any]]:
    pts = (report or {}).get("points") or []
    return [p for p in pts if isinstance(p, dict) and isinstance(p.get("target"), (int, float))]


def summary(report: dict[str, Any] | None) -> str:
    parts = []
    for p in _points(report):
        if "top1" in p:
            parts.append(f"{p['target']:g}x top-1 {p['top1']:.3f} ppl {p['ppl_delta_pct']:+.2f}%")
        elif "rel_error" in p:
            parts.append(f"{p['target']:g}x err {p['rel_error']:.4f}")
    return "; ".join(parts) or "no quality report"
