"""Pieces of the serving benchmarks: the TTFT fetch model, tiled KV, baselines in the prefix cache."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvbench.ttft import fetch_time  # noqa: E402
from kvbench.workloads import tiled_kv  # noqa: E402
from kvcodec.config import CodecConfig  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(
    nbytes=st.floats(1e3, 1e10),
    fp16=st.floats(1e3, 1e10),
    gbit=st.floats(0.1, 100),
    rate=st.floats(0.01, 100),
    chunks=st.integers(1, 64),
)
def test_pipelined_fetch_between_max_and_sum(nbytes, fp16, gbit, rate, chunks):
    f, x, d = fetch_time(nbytes, fp16, gbit, rate, chunks)
    assert x == pytest.approx(nbytes * 8 / (gbit * 1e9))
    assert d == pytest.approx(fp16 / (rate * 1e9))
    assert max(x, d) * (1 - 1e-9) <= f <= (x + d) * (1 + 1e-9)
    if chunks == 1:
        assert f == pytest.approx(x + d)


def test_tiled_kv_uses_real_values_without_duplicate_channels():
    g = torch.Generator().manual_seed(0)
    real = torch.randn(3, 2, 101, 2, 8, generator=g).to(torch.float16)
    out = tiled_kv(real, layers=5, heads=4, head_dim=16, tokens=64)
    assert out.shape == (5, 2, 64, 4, 16) and out.dtype == real.dtype
    vals = set(real.flatten().tolist())
    assert set(out.flatten().tolist()) <= vals
    chans = out.permute(0, 1, 3, 4, 2).reshape(-1, 64)
    assert len({tuple(c.tolist()) for c in chans}) == chans.shape[0]
    # layer 0 / head 0 / first dims are the real cache itself (no shift there)
    assert torch.equal(out[0, :, :64, 0, :8], real[0, :, :64, 0, :])


@pytest.mark.parametrize("method", ["lz4", "raw", "zstd-3"])
def test_baseline_and_raw_methods_in_prefix_cache(method):
    from kvbench.methods import method_codec
    from kvcodec.fetcher import PrefixCache
    from kvcodec.store import open_store

    kv = torch.randn(2, 2, 70, 2, 8).to(torch.float16)
    ids = list(range(100, 170))
    cfg = CodecConfig(quant="exact", chunk_tokens=32, resolutions=((256, 256),))
    pc = PrefixCache(open_store("memory://"), "m", method_codec(method, cfg), "cpu", policy="fixed:0")
    assert pc.put(ids, kv) == 3
    assert pc.lookup(ids) == 70
    res = pc.fetch(ids, 70)
    assert res.error is None and res.tokens_restored == 70
    assert torch.equal(res.kv, kv)


def test_pool_condition_names():
    import click

    from kvbench.interference import pool_workers

    assert pool_workers("kvcodec-pool", 7) == 7
    assert pool_workers("kvcodec-pool:2", 7) == 2
    for bad in ("kvcodec-pool:0", "kvcodec-pool:x", "kvcodec-pool:99", "kvcodec-poolish"):
        with pytest.raises(click.ClickException):
            pool_workers(bad, 7)


def test_interference_rejects_unknown_and_cpu_pool_conditions_before_any_work():
    from click.testing import CliRunner

    from kvbench.interference import command

    r = CliRunner().invoke(command, ["--conditions", "alone,kvcodec-turbo", "--device", "cpu"])
    assert r.exit_code != 0 and "unknown condition 'kvcodec-turbo'" in r.output
    r = CliRunner().invoke(command, ["--conditions", "alone,kvcodec-pool:2", "--device", "cpu"])
    assert r.exit_code != 0 and "needs a CUDA device" in r.output


def test_interference_refuses_a_method_it_cannot_store_before_any_work(tmp_path, synthetic_kvt):
    from click.testing import CliRunner

    from kvbench.interference import command

    kvt = tmp_path / "no.kvt"
    kvt.write_bytes(b"not a kvt")
    cases = [
        (["--method", "kvcodec-transform-5"], "needs a .kvt"),
        (["--method", "kvcodec-transform-5", "--transform", str(kvt)], "--method / --sm-codec / --transform"),
        (["--method", "kvcodec-transform-abc"], "--method / --sm-codec / --transform"),
        (["--sm-codec", "kvcodec-transform-5-ans"], "needs a .kvt"),
        (["--method", "kvcodec-int8", "--transform", str(kvt)], "codes a kvcodec-transform-<ratio> method"),
        (
            [
                "--method",
                "kvcodec-transform-5",
                "--transform",
                str(synthetic_kvt),
                "--conditions",
                "alone,kvcodec-pool",
                "--device",
                "cuda",
            ],
            "HEVC codec",
        ),
        (["--method", "cachegen", "--conditions", "alone,kvcodec-pool:2", "--device", "cuda"], "HEVC codec"),
    ]
    for args, why in cases:  # refused before the model loads (there is none of that name) or CUDA is asked for
        r = CliRunner().invoke(command, ["--device", "cpu", *args, "--model", "no-such-model"])
        assert r.exit_code != 0 and why in r.output, (args, r.output)


def test_interference_takes_a_kvt_for_a_transform_sm_decoder(synthetic_kvt):
    from click.testing import CliRunner

    from kvbench.interference import command

    args = ["--sm-codec", "kvcodec-transform-5-ans", "--transform", str(synthetic_kvt), "--device", "cpu"]
    r = CliRunner().invoke(command, [*args, "--model", "no-such-model"])
    assert r.exit_code != 0 and "--transform" not in r.output and "no-such-model" in r.output  # past the checks


def test_interference_stores_the_kvcodec_conditions_with_the_method_asked_for(synthetic_kvt):
    from kvbench.interference import Settings, store_codec, stored_as

    fields = dict.fromkeys(Settings.__dataclass_fields__)
    s = Settings(**{**fields, "quant": "int8", "method": "kvcodec-transform-5", "transform": str(synthetic_kvt)})
    assert store_codec(s, "kvcodec").id.startswith("transform")
    assert store_codec(dataclasses.replace(s, method="kvcodec"), "kvcodec").id.startswith("hevc")
    doc = {"method": s.method, "transform": "m.kvt", "sm_codec": "cachegen"}
    assert "stored as `kvcodec-transform-5` (.kvt m.kvt); the sm-decoder's as `cachegen`" in stored_as(doc)
    assert "stored as `kvcodec`;" in stored_as({"sm_codec": "cachegen"})  # a record of before --method


def test_conditions_fetch_from_their_stores():
    from kvbench.interference import store_for

    assert store_for("alone") is None
    assert [store_for(c) for c in ("kvcodec", "blocking", "kvcodec-pool:2", "sm-decoder", "raw")] == [
        "kvcodec",
        "kvcodec",
        "kvcodec",
        "sm-decoder",
        "raw",
    ]


def test_ttft_rows_carry_the_engine_split_after_the_fetch_and_tolerate_older_engines():
    from types import SimpleNamespace

    from kvbench.ttft import gap_markdown, method_result

    def run(ttft, fetch, gap=None, first=None):  # noqa: ANN001, ANN202
        out = SimpleNamespace(
            ttft_s=ttft, fetch_s=fetch, bytes_fetched=10, restored_tokens=256, fetch_error=None, token_ids=[1]
        )
        if gap is not None:  # engines before the time points have no such fields
            out.restored_to_prefill_s, out.prefill_to_first_token_s = gap, first
        return out

    new = method_result([run(0.10, 0.07, 0.001, 0.02), run(0.12, 0.08, 0.003, 0.03), run(0.11, 0.09, 0.002, 0.01)])
    assert new["ttft_minus_fetch_s"] == pytest.approx(0.03)
    assert new["restored_to_prefill_s"] == pytest.approx(0.002) and new["prefill_to_first_token_s"] == 0.02
    old = method_result([run(0.10, 0.07), run(0.12, 0.08)])
    assert old["restored_to_prefill_s"] is None and old["ttft_minus_fetch_s"] == pytest.approx(0.035)
    rows = [{"model": "m", "tokens": 8, "bandwidth_gbit": 40.0, "method": "raw", **new}]
    assert "| m | 8 | 40 | raw fp16 KV | 2.0 | 20.0 | 30.0 |" in gap_markdown(rows, ["raw"])


def test_interference_counts_only_its_own_codecs_bytes_in_a_reused_store_folder():
    import torch

    from kvbench.interference import document_bytes
    from kvcodec.codecs import RawCodec
    from kvcodec.fetcher import PrefixCache
    from kvcodec.store import open_store

    store, ids = open_store("memory://"), list(range(600))
    kv = torch.randn(2, 2, 600, 2, 8, dtype=torch.float16)
    raw = PrefixCache(store, "m", RawCodec(chunk_tokens=256), "cpu")
    raw.put(ids, kv)
    alone = sum(store.size(k) for k in store.list())
    assert document_bytes(raw, ids) == alone  # 3 chunks (the last one short): metas and blobs
    zstd = PrefixCache(store, "m", RawCodec(variants=("zstd",), chunk_tokens=256), "cpu")
    zstd.put(ids, kv)
    assert document_bytes(raw, ids) == alone
    assert document_bytes(zstd, ids) == sum(store.size(k) for k in store.list()) - alone
