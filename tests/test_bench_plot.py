"""kvcodec bench plot: the series drawn are the records' numbers; charts are written; bad input is named."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("matplotlib")
from click.testing import CliRunner  # noqa: E402

from kvbench import plot  # noqa: E402
from kvcodec.errors import ConfigError  # noqa: E402


def _ttft_record() -> dict:
    rows = []
    for model, tokens in (("m1", 2048), ("m2", 8192)):
        for bw in (10.0, 1.0, 5.0):
            for method, t in (("raw", 8 / bw), ("kvcodec-int4", 2 / bw + 0.1), ("prefill", 1.5)):
                rows.append({"model": model, "tokens": tokens, "bandwidth_gbit": bw, "method": method, "ttft_s": t})
    return {"benchmark": "ttft", "label": "cpu", "rows": rows}


def test_ttft_series_groups_and_sorts():
    panels = plot.ttft_series(_ttft_record()["rows"])
    assert set(panels) == {("m1", 2048), ("m2", 8192)}
    assert panels[("m1", 2048)]["raw"] == [(1.0, 8.0), (5.0, 1.6), (10.0, 0.8)]
    assert panels[("m2", 8192)]["prefill"] == [(1.0, 1.5), (5.0, 1.5), (10.0, 1.5)]


def _result(cond, rnd, ttft, tpot):  # noqa: ANN001, ANN202
    return {"condition": cond, "round": rnd, "bg_ttft_s": {"p50": ttft}, "bg_tpot_s": {"p50": tpot}}


@settings(max_examples=50, deadline=None)
@given(base=st.lists(st.floats(0.01, 1.0), min_size=1, max_size=5), factor=st.floats(0.5, 3.0))
def test_interference_ratios_are_per_round_medians(base, factor):
    results = []
    for rnd, b in enumerate(base):
        results += [_result("alone", rnd, b, 2 * b), _result("x", rnd, b * factor, 2 * b * factor)]
    ratios = plot.interference_ratios(results, "alone")
    assert ratios["alone"] == (1.0, 1.0)
    assert ratios["x"][0] == pytest.approx(factor) and ratios["x"][1] == pytest.approx(factor)
    assert plot.interference_ratios(results, "raw") == {}


def test_fetch_series_keeps_constant_rate_traces():
    recs = [
        {"trace": "const-1gbit", "policy": "adaptive", "bandwidth_gbit": 1, "fetch_s": 0.1, "bound_s": 0.09},
        {"trace": "lognormal-x", "policy": "adaptive", "bandwidth_gbit": 4, "fetch_s": 0.05, "bound_s": 0.02},
    ]
    assert plot.fetch_series(recs) == {"adaptive": [(1.0, 0.1, 0.09)]}


def test_plot_files_and_cli(tmp_path):
    ttft = tmp_path / "ttft-x.json"
    ttft.write_text(json.dumps(_ttft_record()))
    interf = tmp_path / "interference-x.json"
    interf.write_text(
        json.dumps(
            {
                "benchmark": "interference",
                "model": "m",
                "link_gbit": 10,
                "rounds": 2,
                "results": [
                    _result(c, r, 0.03 * (1 + i), 0.02 * (1 + i))
                    for r in range(2)
                    for i, c in enumerate(("alone", "raw", "kvcodec-pool:7"))
                ],
            }
        )
    )
    out = plot.plot_file(str(ttft))
    svg = (tmp_path / "ttft-x.svg").read_text()
    assert out.endswith("ttft-x.svg") and "<svg" in svg and "m2, 8192 tokens" in svg and "raw fp16 KV" in svg
    first = svg
    plot.plot_file(str(ttft))
    assert (tmp_path / "ttft-x.svg").read_text() == first  # no timestamps, stable ids: same data, same file
    r = CliRunner().invoke(plot.command, [str(interf), "--out-dir", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert "kvcodec-pool:7" in (tmp_path / "o" / "interference-x.svg").read_text()


def test_plot_rejects_what_it_cannot_draw(tmp_path):
    with pytest.raises(ConfigError, match="no chart for benchmark 'ratio'"):
        plot.result_kind({"benchmark": "ratio"})
    bad = tmp_path / "ttft-empty.json"
    bad.write_text(json.dumps({"benchmark": "ttft", "rows": []}))
    r = CliRunner().invoke(plot.command, [str(bad)])
    assert r.exit_code != 0 and "no rows to plot" in r.output
    r = CliRunner().invoke(plot.command, ["--results", str(tmp_path / "nothing")])
    assert r.exit_code != 0 and "no result JSONs" in r.output
