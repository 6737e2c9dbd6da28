"""Calibration's guarantees without a model (the per-channel fallback: test_transform_fallback.py): the
quality report's choices (quality.py), RoPE read from transformers 5 configs (explicit frequencies for other scalings)
and KV files of layer groups (kvspec.files)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.errors import ConfigError
from kvcodec.transform.quality import highest_passing, parse_target, ratio_for, ratio_warning, safe_ratio
from kvcodec.transform.rope import RopeSpec, apply_rope, inv_freq, remove_rope

REPORT = {
    "metric": "model",
    "points": [
        {"target": 3.0, "ratio": 3.0, "top1": 0.998, "ppl_delta_pct": 0.02},
        {"target": 5.0, "ratio": 5.0, "top1": 0.991, "ppl_delta_pct": 0.3},
        {"target": 8.0, "ratio": 8.0, "top1": 0.97, "ppl_delta_pct": 0.9},
    ],
}


def test_target_quality_and_the_safe_ratio():
    assert parse_target("0.99") == ("top1", 0.99) and parse_target("ppl<=0.5") == ("ppl", 0.5)
    with pytest.raises(ConfigError, match="target-quality"):
        parse_target("speed=3")
    assert (
        ratio_for(REPORT, "top1=0.99") == 5.0
        and ratio_for(REPORT, "ppl=1") == 8.0
        and ratio_for(REPORT, "0.995") == 3.0
    )
    with pytest.raises(ConfigError, match="no calibrated ratio met top1"):
        ratio_for(REPORT, "top1=0.999")
    with pytest.raises(ConfigError, match="has a model's quality report: it cannot pick"):
        ratio_for(REPORT, "err=0.1")
    with pytest.raises(ConfigError, match="has no quality report: it cannot pick"):
        ratio_for(None, "top1=0.99")
    assert (
        safe_ratio(REPORT) == 5.0 and ratio_warning(REPORT, 5) is None and "safe ratio 5x" in ratio_warning(REPORT, 6)
    )
    assert ratio_warning(None, 12) is None
    kv_report = {"metric": "kv", "points": [{"target": 4.0, "ratio": 4.0, "rel_error": 0.01}]}
    assert ratio_for(kv_report, "err=0.02") == 4.0 and safe_ratio(kv_report) == 4.0


def test_a_ratio_above_one_that_lost_is_not_safe():
    """Qwen2.5's report passed 8x (0.996) after 5x lost (0.984): the safe ratio is 4x, not 8x."""
    pts = [(3, 1.0), (4, 0.996), (5, 0.984), (6, 0.988), (8, 0.996), (10, 0.973)]
    report = {"metric": "model", "points": [{"target": t, "top1": a, "ppl_delta_pct": 0.0} for t, a in pts]}
    assert safe_ratio(report) == 4.0 and ratio_for(report, "top1=0.99") == 4.0 and ratio_for(report, "0.97") == 10.0
    assert "safe ratio 4x" in ratio_warning(report, 8)


def test_a_point_that_did_not_reach_its_ratio_is_not_safe():
    """3 held-out tokens were stored nearly whole (0.99x at every target): 'err 0.0000, safe 10x', and
    encode --target-quality then chose 10x on that report."""
    whole = {"metric": "kv", "points": [{"target": t, "ratio": 0.987, "rel_error": 0.0} for t in (3.0, 5.0, 10.0)]}
    assert safe_ratio(whole) is None
    with pytest.raises(ConfigError, match="no calibrated ratio met err"):
        ratio_for(whole, "err=0.01")
    half = {"metric": "kv", "points": [{"target": 4.0, "ratio": 2.1, "rel_error": 0.0}]}
    assert safe_ratio(half) == 4.0  # a short text's ratio falls below its target; half of it still measures


def test_a_held_out_source_that_is_fitted_or_too_short_is_refused_before_the_fit():
    import click

    from kvcodec.cli.calibrate import check_held_out

    check_held_out(["pg/a", "pg/b"], ["pg/c"], [36], 4)
    with pytest.raises(click.BadParameter, match="pg/a is both fitted and held out"):
        check_held_out(["pg/a", "pg/b"], ["pg/a"], [500], 4)
    with pytest.raises(click.BadParameter, match=r"pg/c \(35\) has fewer than 36 tokens"):
        check_held_out(["pg/a"], ["pg/c"], [35], 4)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(2, 16), st.booleans(), max_size=8))
def test_highest_passing_is_the_top_of_the_passing_run_from_the_lowest_ratio(outcomes):
    points = [{"target": float(t), "ok": ok} for t, ok in outcomes.items()]
    best = highest_passing(points, lambda p: p["ok"])
    if best is None:
        assert not outcomes or not outcomes[min(outcomes)]
    else:
        assert all(ok for t, ok in outcomes.items() if t <= best)  # nothing at or below it lost
        above = [t for t in outcomes if t > best]
        assert not above or not outcomes[min(above)]  # the next measured ratio lost


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["yarn", "longrope", "dynamic", "linear", "llama3", "default"]), st.sampled_from([0.5, 1.0]))
def test_rope_of_any_scaling_matches_transformers_and_inverts(kind, partial):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": kind, "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 256}
    if kind == "llama3":
        params.update(low_freq_factor=1.0, high_freq_factor=4.0)
    if kind == "longrope":
        params.update(short_factor=[1.0] * int(32 * partial / 2), long_factor=[2.0] * int(32 * partial / 2))
    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=2, num_hidden_layers=1, max_position_embeddings=1024,
        rope_parameters=params, partial_rotary_factor=partial,
    )  # fmt: skip
    spec = RopeSpec.from_hf_config(config)
    assert spec.rotary == int(32 * partial)
    if kind != "default":
        want = ROPE_INIT_FUNCTIONS[kind](config, "cpu")[0].to(torch.float64)
        assert torch.allclose(inv_freq(spec), want, rtol=1e-6)
    assert RopeSpec.from_dict(spec.to_dict()) == spec
    x = torch.randn(2, 5, 3, 32)
    pos = torch.arange(100, 105)
    assert torch.allclose(remove_rope(apply_rope(x, pos, spec), pos, spec), x, atol=1e-5)


def test_rope_per_layer_type_and_interleaved_models():
    transformers = pytest.importorskip("transformers")
    gemma = transformers.Gemma3TextConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    )  # fmt: skip
    local, glob = (RopeSpec.from_hf_config(gemma, t) for t in ("sliding_attention", "full_attention"))
    assert (local.theta, glob.theta, glob.scaling, glob.factor) == (10000.0, 1e6, "linear", 8.0)
    with pytest.raises(ConfigError, match="not for 'chunked_attention'"):
        RopeSpec.from_hf_config(gemma, "chunked_attention")
    glm = transformers.AutoConfig.for_model("glm", hidden_size=64, num_attention_heads=2, num_hidden_layers=1)
    assert RopeSpec.from_hf_config(glm).style == "interleaved"


def test_grouped_kv_files_round_trip(tmp_path):
    from kvcodec.kvspec import GroupedKV, KVSpec, LayerSpec
    from kvcodec.kvspec.files import load_kv_file, save_kv_file

    spec = KVSpec((LayerSpec("sliding", (2, 8), (2, 8), keep=15), LayerSpec("mla", (1, 16), (1, 4))), "float16")
    gkv = GroupedKV.empty(spec, 40, window=False)
    for t in gkv.tensors:
        t.copy_(torch.randn(t.shape))
    save_kv_file(tmp_path / "g.safetensors", gkv, {"model": "m"})
    back, meta = load_kv_file(tmp_path / "g.safetensors")
    assert back.equal(gkv) and meta["model"] == "m"
    save_kv_file(tmp_path / "p.safetensors", gkv.tensors[0], {})
    plain, _ = load_kv_file(tmp_path / "p.safetensors")
    assert torch.equal(plain, gkv.tensors[0])


def test_gguf_config_from_the_header_alone_matches_the_model():
    from kvcodec.models.check import inspect_model
    from kvcodec.models.gguf_config import read_header
    from kvcodec.models.registry import gguf_path

    try:
        path = gguf_path("smollm2-135m")
    except ConfigError as e:
        pytest.skip(f"no GGUF model here: {e}")
    fields, tensors = read_header(path)
    assert fields["general.architecture"] == "llama" and "token_embd.weight" in tensors
    layout = inspect_model(str(path))
    assert [g.name for g in layout.spec.groups] == ["full-kv-3x64"] and len(layout.spec.layers) == 30
    assert layout.ropes[0] == RopeSpec(100000.0, 64, 64)


def test_a_report_of_another_coder_is_named_when_a_codec_is_made(synthetic_kvt, tmp_path, caplog):
    """A .kvt whose quality report measured mixed chunks (before session 53) under today's zstd default:
    a warning names both coders; none where they agree."""
    from kvcodec.codecs.transform.codec import DEFAULT_CODER, coder_warning, make_transform_codec
    from kvcodec.transform import load_kvt, save_kvt

    cal, _ = load_kvt(synthetic_kvt)
    path = tmp_path / "mixed-report.kvt"
    save_kvt(dataclasses.replace(cal, info={**cal.info, "quality": {"coder": "mixed", "points": []}}), path)
    with caplog.at_level(logging.WARNING, logger="kvcodec.codecs.transform.codec"):
        make_transform_codec(path, target_ratio=5.0)
    assert any("measured mixed-coded chunks" in r.message and DEFAULT_CODER in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcodec.codecs.transform.codec"):
        make_transform_codec(path, target_ratio=5.0, coder="mixed")
    assert not [r for r in caplog.records if "coded chunks" in r.message]
    assert coder_warning({"points": []}, "zstd") is None and coder_warning({"coder": "zstd"}, "zstd") is None
