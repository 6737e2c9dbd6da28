"""`kvcodec demo` end to end on a short document (real model, file store, throttled link)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from kvcodec.cli.demo import command  # noqa: E402

pytestmark = pytest.mark.slow


def test_demo_short_document(tmp_path):
    import torch

    torch.set_num_threads(1)  # leaves a core to the fetch / store threads; faster on a shared CPU
    out = tmp_path / "demo.json"
    args = [
        "--doc-tokens",
        "96",
        "--chunk-tokens",
        "32",
        "--max-new-tokens",
        "3",
        "--gbit",
        "0.2",
        "--quant",
        "exact",
        "--store",
        str(tmp_path / "store"),
        "--device",
        "cpu",
        "--json-out",
        str(out),
    ]
    res = CliRunner().invoke(command, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "greedy answers identical: raw reuse yes, kvcodec yes" in res.output
    rec = json.loads(out.read_text())
    assert rec["restored_tokens"]["raw"] == rec["restored_tokens"]["kvcodec"] >= 64
    assert rec["bytes_fetched"]["raw"] > 0 and rec["bytes_fetched"]["kvcodec"] > 0
    assert set(rec["ttft_s"]) == {"prefill", "raw", "kvcodec"}
    assert rec["identical"] == {"raw": True, "kvcodec": True}
