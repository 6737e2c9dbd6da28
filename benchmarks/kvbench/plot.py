"""`kvcodec bench plot`: SVG charts of benchmark results, written next to their JSON files.

    kvcodec bench plot                                    # every ttft-*, fetch-*, interference-* result
    kvcodec bench plot benchmarks/results/ttft-gpu-h200-e2e.json

- ttft: TTFT vs link bandwidth (log-log), one panel per model and prefix length, one line per method;
- fetch: fetch time vs link bandwidth per policy on constant-rate traces, with the bound;
- interference: background TTFT / TPOT p50 per condition relative to alone (and to raw when the run
  has that condition); medians over rounds when the run has several.

The figures are drawn from the JSON alone (pure functions of the records), so a chart always
matches the committed numbers; SVGs carry no timestamp, so an unchanged result gives the same file.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
from collections.abc import Iterable

import click

from kvbench.methods import label as method_label
from kvbench.results import RESULTS_DIR
from kvcodec.errors import ConfigError

DEFAULT_RESULTS = str(RESULTS_DIR)
PATTERNS = ("ttft-*.json", "fetch-*.json", "interference-*.json")
METHOD_ORDER = (
    "prefill",
    "raw",
    "zstd-3",
    "cachegen",
    "kvcodec-int8",
    "kvcodec-int6",
    "kvcodec-int4",
    "kvcodec-int3",
    "kvcodec-transform-5",
    "kvcodec-transform-8",
)


def result_kind(record: dict) -> str:
    """Which chart a result JSON gets: 'ttft', 'fetch' or 'interference'."""
    kind = record.get("benchmark")
    if kind in ("ttft", "interference"):
        return kind
    if kind == "fetch" or ("records" in record and "link" in record):
        return "fetch"
    raise ConfigError(f"no chart for benchmark {kind!r} (known: ttft, fetch, interference)")


def ttft_series(rows: Iterable[dict]) -> dict[tuple[str, int], dict[str, list[tuple[float, float]]]]:
    """{(model, tokens): {method: [(bandwidth_gbit, ttft_s), ...] sorted by bandwidth}}."""
    panels: dict[tuple[str, int], dict[str, list[tuple[float, float]]]] = {}
    for r in rows:
        if r.get("ttft_s") is None:
            continue
        panel = panels.setdefault((str(r["model"]), int(r["tokens"])), {})
        panel.setdefault(r["method"], []).append((float(r["bandwidth_gbit"]), float(r["ttft_s"])))
    for panel in panels.values():
        for points in panel.values():
            points.sort()
    return panels


def modelled_series(rows: Iterable[dict]) -> dict[tuple[str, int], dict[str, list[tuple[float, float]]]]:
    """The points of ttft_series that a run modelled instead of measuring (rows with measured False)."""
    return ttft_series(r for r in rows if r.get("measured") is False)


def fetch_series(records: Iterable[dict]) -> dict[str, list[tuple[float, float, float]]]:
    """{policy: [(bandwidth_gbit, fetch_s, bound_s), ...]} for the constant-rate traces."""
    out: dict[str, list[tuple[float, float, float]]] = {}
    for r in records:
        if not str(r.get("trace", "")).startswith("const"):
            continue
        out.setdefault(r["policy"], []).append((float(r["bandwidth_gbit"]), float(r["fetch_s"]), float(r["bound_s"])))
    for points in out.values():
        points.sort()
    return out


def interference_ratios(results: list[dict], reference: str) -> dict[str, tuple[float, float]]:
    """{condition: (bg TTFT p50, bg TPOT p50) relative to `reference`}: per round against the same
    round's reference, median over rounds. Empty when the run has no `reference` condition."""
    refs = {r.get("round", 0): r for r in results if r["condition"] == reference}
    per_cond: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        ref = refs.get(r.get("round", 0))
        if ref is None:
            continue
        try:
            ratio = (r["bg_ttft_s"]["p50"] / ref["bg_ttft_s"]["p50"], r["bg_tpot_s"]["p50"] / ref["bg_tpot_s"]["p50"])
        except (TypeError, ZeroDivisionError):
            continue
        per_cond.setdefault(r["condition"], []).append(ratio)
    return {c: (statistics.median(t for t, _ in v), statistics.median(p for _, p in v)) for c, v in per_cond.items()}


def _method_key(m: str) -> tuple[int, str]:
    return (METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER), m)


def _figure(panels: int, width: float = 4.2, height: float = 3.2):  # noqa: ANN202
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, max(1, panels))
    rows = (panels + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    for ax in axes.flat[panels:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _save(fig, path: str) -> None:  # noqa: ANN001
    import matplotlib
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "kvcodec"  # stable element ids: same data, same file
    fig.tight_layout()
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "svg"
    fig.savefig(path, format=fmt, metadata={"Date": None} if fmt == "svg" else None)
    plt.close(fig)


def plot_ttft(record: dict, path: str) -> None:
    panels = ttft_series(record.get("rows", []))
    if not panels:
        raise ConfigError("the TTFT result has no rows to plot")
    modelled = modelled_series(record.get("rows", []))
    fig, axes = _figure(len(panels))
    for ax, ((model, tokens), series) in zip(axes, sorted(panels.items())):
        for method in sorted(series, key=_method_key):
            xs, ys = zip(*series[method])
            style = "--" if method == "prefill" else "-"
            (line,) = ax.plot(xs, ys, style, marker="o", markersize=3, label=method_label(method))
            guessed = modelled.get((model, tokens), {}).get(method)
            if guessed:  # modelled points: hollow markers
                gx, gy = zip(*guessed)
                ax.plot(gx, gy, "o", markersize=5, markerfacecolor="white", color=line.get_color())
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{model}, {tokens} tokens", fontsize=9)
        ax.set_xlabel("link Gbit/s")
        ax.set_ylabel("TTFT s")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    mode = record.get("mode") or "modeled from measured parts"
    if modelled:
        mode += "; hollow: modelled"
    fig.suptitle(f"TTFT vs bandwidth ({record.get('label', record.get('device', ''))}, {mode})", fontsize=10)
    _save(fig, path)


def plot_fetch(record: dict, path: str) -> None:
    series = fetch_series(record.get("records", []))
    if not series:
        raise ConfigError("the fetch result has no constant-rate records to plot")
    fig, axes = _figure(1, width=5.5, height=3.8)
    ax = axes[0]
    bound = {}
    for policy in sorted(series):
        xs, fetch, bounds = zip(*series[policy])
        ax.plot(xs, [f * 1e3 for f in fetch], marker="o", markersize=3, label=policy)
        if policy != "raw-fp16":
            for x, b in zip(xs, bounds):
                bound[x] = min(bound.get(x, b), b)
    if bound:
        xs = sorted(bound)
        ax.plot(xs, [bound[x] * 1e3 for x in xs], "k:", label="bound (kvcodec)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link Gbit/s")
    ax.set_ylabel("fetch ms")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"fetch of {_kv_title(record)} KV ({record.get('link', '')})", fontsize=9)
    _save(fig, path)


def _kv_title(record: dict) -> str:
    """A fetch record's KV as its title names it: the shape, or a grouped file's group names (its shapes are long)."""
    groups = record.get("kv_groups")
    if groups:
        return f"{len(groups)} layer groups ({', '.join(groups)})"
    return str(tuple(record.get("kv_shape", ())))


def plot_interference(record: dict, path: str) -> None:
    results = record.get("results", [])
    refs = [c for c in ("alone", "raw") if any(r["condition"] == c for r in results)]
    if not refs:
        raise ConfigError("the interference result has no 'alone' condition to compare with")
    fig, axes = _figure(len(refs), width=5.5, height=3.6)
    rounds = record.get("rounds", 1)
    for ax, ref in zip(axes, refs):
        ratios = interference_ratios(results, ref)
        conds = list(dict.fromkeys(r["condition"] for r in results))
        xs = range(len(conds))
        ax.bar([x - 0.2 for x in xs], [ratios.get(c, (0, 0))[0] for c in conds], width=0.4, label="bg TTFT p50")
        ax.bar([x + 0.2 for x in xs], [ratios.get(c, (0, 0))[1] for c in conds], width=0.4, label="bg TPOT p50")
        ax.axhline(1.0, color="k", linewidth=0.8)
        if ref == "alone":
            ax.axhline(1.05, color="r", linewidth=0.8, linestyle=":", label="+5% (target)")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(conds, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(f"relative to {ref}" + (f" (median of {rounds} rounds)" if rounds > 1 else ""))
        ax.legend(fontsize=7)
    fig.suptitle(f"interference: {record.get('model', '')}, link {record.get('link_gbit', '')} Gbit/s", fontsize=10)
    _save(fig, path)


PLOTTERS = {"ttft": plot_ttft, "fetch": plot_fetch, "interference": plot_interference}


def plot_file(json_path: str, out_dir: str | None = None) -> str:
    """Draw the chart of one result JSON; returns the SVG's path (beside the JSON by default)."""
    with open(json_path) as f:
        record = json.load(f)
    kind = result_kind(record)
    name = os.path.splitext(os.path.basename(json_path))[0] + ".svg"
    path = os.path.join(out_dir or os.path.dirname(json_path) or ".", name)
    PLOTTERS[kind](record, path)
    return path


@click.command("plot")
@click.argument("files", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--results",
    "results_dir",
    default=DEFAULT_RESULTS,
    show_default=True,
    help="Where to look for result JSONs when no FILES are given.",
)
@click.option("--out-dir", default=None, help="Write the SVGs here (default: beside each JSON).")
def command(files, results_dir, out_dir) -> None:  # noqa: ANN001
    """SVG charts of ttft, fetch and interference results (needs matplotlib: pip install -e 'benchmarks[plot]')."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        raise click.ClickException("plotting needs matplotlib: pip install -e 'benchmarks[plot]'") from None
    paths = list(files) or sorted(p for pat in PATTERNS for p in glob.glob(os.path.join(results_dir, pat)))
    if not paths:
        raise click.ClickException(f"no result JSONs given or found under {results_dir}")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    failed = 0
    for p in paths:
        try:
            click.echo(f"{p} -> {plot_file(p, out_dir)}")
        except (ConfigError, KeyError, ValueError, json.JSONDecodeError) as e:
            failed += 1
            click.echo(f"{p}: skipped ({type(e).__name__}: {e})", err=True)
    if failed == len(paths):
        raise click.ClickException("no chart could be drawn")
