"""`kvcodec bench ratio --layer-bits-schemes`: scheme parsing and the per-layer quantized symbols."""

from __future__ import annotations

import click
import pytest
import torch
from click.testing import CliRunner

import kvcodec
from kvbench import ratio
from kvcodec.quant import integer


@pytest.mark.parametrize(
    "spec, n, expected",
    [
        ("all:3", 4, (3, 3, 3, 3)),
        ("first2:4,rest:3", 5, (4, 4, 3, 3, 3)),
        ("rest:3,first2:4", 4, (4, 4, 3, 3)),  # later items override; rest fills what is unset
        ("last1:5,rest:2", 3, (2, 2, 5)),
        ("1-2:6,0:8,rest:4", 4, (8, 6, 6, 4)),
        ("all:3, 0:5 ,", 3, (5, 3, 3)),
        ("first3:4,rest:3", 3, (4, 4, 4)),  # an empty rest is fine
    ],
)
def test_parse_layer_bits_scheme(spec, n, expected):
    assert ratio.parse_layer_bits_scheme(spec, n) == expected


@pytest.mark.parametrize("spec", ["first2:4", "all:9", "all:1", "all", "first9:4,rest:3", "bogus:3", "0-7:3", ""])
def test_parse_layer_bits_scheme_rejects(spec):
    with pytest.raises(click.BadParameter):
        ratio.parse_layer_bits_scheme(spec, 4)


def test_quantized_symbols_follow_layer_bits():
    torch.manual_seed(0)
    kv = torch.randn(3, 2, 20, 2, 8).to(torch.float16)
    bits = (4, 3, 2)
    symbols, side = ratio.quantized_symbols(kv, "int4", 8, bits)
    assert symbols.shape == (1, 3, 2, 20, 2, 8)
    for layer, b in enumerate(bits):
        assert int(symbols[0, layer].max()) <= 2**b - 1
        assert int(symbols[0, layer].max()) == 2**b - 1  # min-max quantization reaches the top level
    # same integers as a uniform width where the widths agree
    uni, side_uni = ratio.quantized_symbols(kv, "int4", 8)
    assert torch.equal(uni[0, 0], symbols[0, 0]) and side == side_uni
    # and the same integers the codec stores: its restore equals dequantizing them
    data = kvcodec.encode(kv, kvcodec.CodecConfig(quant="int4", chunk_tokens=8, layer_bits=bits, sample_coder="zstd"))
    restored = kvcodec.decode(data)
    x = kv[:, :, :8]
    off, step = integer.minmax_params(x, torch.tensor(bits))
    expect = integer.dequantize(symbols[0, :, :, :8], off, step, kv.dtype)
    assert torch.equal(restored[:, :, :8], expect)


def test_command_rejects_bad_scheme_before_loading_models(tmp_path):
    res = CliRunner().invoke(ratio.command, ["--layer-bits-schemes", "first8:4;rest=3", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "not SEL:BITS" in res.output
    assert not list(tmp_path.iterdir())


def test_target_ratios_without_a_transform_and_a_kvt_of_another_shape_are_refused_before_models_load(
    tmp_path, synthetic_kvt, monkeypatch
):
    import kvcodec.models

    monkeypatch.setattr(kvcodec.models, "load_model", lambda *a, **k: pytest.fail("a model loaded first"))
    res = CliRunner().invoke(ratio.command, ["--target-ratios", "5", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "--target-ratios needs --transform" in res.output
    args = ["--models", "smollm2-135m", "--transform", str(synthetic_kvt), "--out", str(tmp_path)]
    res = CliRunner().invoke(ratio.command, args)
    assert res.exit_code == 2 and "--transform" in res.output, res.output
    assert not list(tmp_path.glob("ratio-*"))


@pytest.mark.slow
def test_a_transform_method_is_recorded_with_its_ratio_and_accuracy(smollm2, tmp_path):
    """SmolLM2's KV of 300 tokens (a chunk and a short one) through the transform of a .kvt calibrated on two
    other essays, at 5x: its stored bytes (every chunk's) give the ratio, and its accuracy is scored."""
    from kvcodec.integrations.hf import extract_kv
    from kvcodec.models.texts import load_text
    from kvcodec.transform import RopeSpec, calibrate, save_kvt

    model, tok = smollm2
    kvs = [extract_kv(model, tok, load_text(t, max_chars=4000), 400)[1] for t in ("pg/aord", "pg/apple")]
    kvt = tmp_path / "smollm2.kvt"
    save_kvt(calibrate(kvs, RopeSpec.from_hf_config(model.config), info={"model": "smollm2-135m"}), kvt)
    ids = tok(load_text("pg/addiction"), return_tensors="pt").input_ids[0]
    _, kv32 = extract_kv(model, tok, load_text("pg/addiction"), max_tokens=300)
    p = ratio.Prefix("smollm2-135m", "pg/addiction", model, kv32, kv32.half(), ids[:300], ids[300:428], ids[300:316])
    out = ratio.Records(p, lambda m: None)
    ratio.measure_transform(p, out, "kvcodec-transform-5", kvt, 256, 8)
    (rec,) = out.rows
    assert rec["codec"] == "kvcodec-transform" and rec["quant"] == "kvcodec-transform-5" and rec["target_ratio"] == 5
    assert rec["ratio_vs_fp16"] == pytest.approx(5, rel=0.15)
    assert 0 < rec["kv_error"]["rel_rms"] < 0.5
    assert rec["ppl_delta"] != 0 and 0 < rec["token_agreement"] <= 1
