"""`kvcodec bench fetch --kv GROUPED.safetensors`: a KV file of several layer groups (sliding-window, MLA) stored
and fetched with GroupedPrefixCache, raw fp16 and coded (in-process store, token-bucket link: no redis-server)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvcodec.kvspec import GroupedKV, KVSpec, LayerSpec
from kvcodec.kvspec.files import save_kv_file
from synthetic import ROPE, D, H, synthetic_kv
from test_grouped_prefix import _kv as mla_kv

CT = 16
# sliding and full layers of the synthetic model's shape: a grouped .kvt of its calibrations codes them
SPEC = KVSpec(
    (*[LayerSpec("sliding", (H, D), (H, D), keep=24)] * 2, *[LayerSpec("full", (H, D), (H, D))] * 2), "float16"
)


def _synthetic(tokens: int, seed: int) -> GroupedKV:
    """Every group from position 0 (as kvcodec extract records sliding layers), each of the synthetic model."""
    tensors = tuple(synthetic_kv(tokens, seed + i, layers=len(g.layers)) for i, g in enumerate(SPEC.groups))
    return GroupedKV(SPEC, tokens, (0,) * len(tensors), tensors)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from kvcodec.transform import calibrate
    from kvcodec.transform.grouped_kvt import grouped_to_bytes

    d = tmp_path_factory.mktemp("grouped")
    save_kv_file(d / "mla.safetensors", mla_kv(48), {})  # sliding, MLA latent and RoPE key, full groups
    save_kv_file(d / "synthetic.safetensors", _synthetic(64, 3), {"model": "synthetic"})
    save_kv_file(d / "windowed.safetensors", _synthetic(64, 3).prefix(64), {})  # the sliding group from 40 only
    cals = {g.name: calibrate([synthetic_kv(600, s, layers=len(g.layers)) for s in (1, 2)], ROPE) for g in SPEC.groups}
    (d / "grouped.kvt").write_bytes(grouped_to_bytes(SPEC, cals, {"model": "synthetic"}))
    return d


def _bench(tmp_path, *args: str):
    from kvbench.fetch import command

    base = ["--chunk-tokens", str(CT), "--rates", "4", "--jitter-mean", "0", "--link", "token-bucket"]
    base += ["--store", "memory", "--repeats", "1", "--device", "cpu", "--out-dir", str(tmp_path / "results")]
    return CliRunner().invoke(command, [*base, *args])


def _doc(tmp_path) -> dict:
    (path,) = (tmp_path / "results").glob("fetch-*.json")
    return json.loads(path.read_text())


def test_a_grouped_file_is_fetched_raw_and_hevc_coded_its_prefix_cut_on_the_token_axis(tmp_path, files):
    res = _bench(tmp_path, "--kv", str(files / "mla.safetensors"), "--tokens", "40", "--method", "kvcodec-int8")
    assert res.exit_code == 0, res.output + repr(res.exception)
    doc = _doc(tmp_path)
    kv = mla_kv(48)
    assert doc["kv_groups"] == [g.name for g in kv.spec.groups]
    assert doc["kv_shape"] == [[*t.shape[:2], 40, *t.shape[3:]] for t in kv.tensors]
    assert doc["codec"].startswith("grouped-") and doc["decode_profile"] is None
    recs = {r["policy"]: r for r in doc["records"]}
    assert list(recs) == ["fixed:0", "raw-fp16"]
    fp16 = 2 * sum(t[:, :, :40].numel() for t in kv.tensors)
    for r in recs.values():
        assert (r["prefix_tokens"], r["tokens_restored"], r["fp16_bytes"]) == (40, 40, fp16)
        assert r["stats"]["chunks_restored"] == 3  # 16 + 16 + 8 tokens
    assert recs["raw-fp16"]["bit_exact"] is True and recs["fixed:0"]["bit_exact"] is None
    assert "mla-latent-1x8 (1, 2, 40, 1, 8)" in next((tmp_path / "results").glob("*.md")).read_text()


def test_a_grouped_file_is_fetched_with_the_grouped_kvts_transform(tmp_path, files):
    kv, kvt = files / "synthetic.safetensors", files / "grouped.kvt"
    res = _bench(
        tmp_path, "--kv", str(kv), "--tokens", "100", "--method", "kvcodec-transform-4", "--transform", str(kvt)
    )
    assert res.exit_code == 0, res.output + repr(res.exception)
    doc = _doc(tmp_path)
    assert doc["codec"].startswith("grouped-") and doc["transform"] == str(kvt)
    recs = {r["policy"]: r for r in doc["records"]}
    coded, raw = recs["fixed:0"], recs["raw-fp16"]
    assert coded["prefix_tokens"] == coded["tokens_restored"] == raw["tokens_restored"] == 64  # all of the file's
    assert coded["fp16_bytes"] == raw["fp16_bytes"] == 2 * 4 * 2 * 64 * H * D
    assert raw["bit_exact"] and raw["bytes"] / coded["bytes"] > 2


def test_a_grouped_file_whose_sliding_group_holds_only_its_window_is_refused(tmp_path, files):
    for tokens in ("32", "64"):
        res = _bench(tmp_path, "--kv", str(files / "windowed.safetensors"), "--tokens", tokens)
        assert res.exit_code == 2, res.output
        assert "hold only their last positions" in res.output and "from 40, of 64" in res.output, res.output
    assert not (tmp_path / "results").exists()


def test_a_kvt_of_the_other_kind_than_the_kv_is_refused_before_any_encoding(tmp_path, files, synthetic_kvt):
    from safetensors.torch import save_file

    plain = tmp_path / "plain.safetensors"
    save_file({"kv": synthetic_kv(64, 3)}, str(plain))
    method = ["--method", "kvcodec-transform-4", "--transform"]
    for args, says in [
        (["--kv", str(files / "synthetic.safetensors"), *method, str(synthetic_kvt)], "calibrated for one KV tensor"),
        (["--kv", str(plain), *method, str(files / "grouped.kvt")], "calibrated for layer groups"),
        ([*method, str(files / "grouped.kvt")], "give the grouped model's KV file as --kv"),  # a prefill: one tensor
        (["--kv", str(files / "mla.safetensors"), *method, str(files / "grouped.kvt")], "not for KV group sliding5"),
    ]:
        res = _bench(tmp_path, "--model", "no-such-model", *args)
        assert res.exit_code == 2 and says in res.output, (args, res.output)
    assert not (tmp_path / "results").exists()
