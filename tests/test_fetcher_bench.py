"""Smoke test of `kvcodec bench fetch` on a tiny saved KV (token-bucket link, real redis-server)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from kvbench.net.redis_server import redis_server_binary

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(redis_server_binary() is None, reason="redis-server binary not installed"),
]


def test_bench_fetch_writes_records(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from kvbench.fetch import command

    monkeypatch.setenv("KVCODEC_CACHE_DIR", str(tmp_path / "cache"))
    g = torch.Generator().manual_seed(0)
    kv = torch.randn((2, 2, 64, 2, 32), generator=g).half()
    save_file({"kv": kv, "token_ids": torch.arange(64)}, str(tmp_path / "kv.safetensors"))
    out = tmp_path / "results"
    res = CliRunner().invoke(
        command,
        [
            "--kv",
            str(tmp_path / "kv.safetensors"),
            "--tokens",
            "64",
            "--chunk-tokens",
            "32",
            "--resolutions",
            "256x256,512x512",
            "--rates",
            "2",
            "--jitter-mean",
            "1",
            "--policies",
            "fixed:0,adaptive,raw-fp16",
            "--link",
            "token-bucket",
            "--repeats",
            "1",
            "--out-dir",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output + repr(res.exception)
    files = list(out.glob("fetch-*.json"))
    assert len(files) == 1 and files[0].with_suffix(".md").exists()
    doc = json.loads(files[0].read_text())
    recs = doc["records"]
    assert len(recs) == 2 * 3  # (2 Gbit/s, jitter) x 3 policies
    for r in recs:
        for k in (
            "bandwidth_gbit",
            "prefix_tokens",
            "policy",
            "fetch_s",
            "bound_s",
            "time_over_bound",
            "link",
            "machine",
            "timeline",
        ):
            assert k in r
        assert r["link"] == "token-bucket" and r["prefix_tokens"] == 64
        assert r["fetch_s"] > 0 and r["bound_s"] > 0
    raw = [r for r in recs if r["policy"] == "raw-fp16"]
    assert all(r["bit_exact"] for r in raw)
    # the token bucket really limits: the fetch takes at least bytes / rate
    assert all(r["fetch_s"] >= r["bytes"] * 8 / 2e9 for r in raw if r["bandwidth_gbit"] == 2)
