"""`kvcodec bench accuracy --transform MODEL.kvt --target-ratios ...`: the transform codec's methods
(kvcodec-transform-<r>), refused early where they cannot be measured, and their round trips."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from kvbench.accuracy import command, exact_failures, restore, table
from kvbench.methods import chunked_transform_codec, transform_ratio
from kvbench.transform_options import transform_method_names
from synthetic import ROPE, rel_mse, synthetic_kv

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def model_config():
    """The default model's config can be read here (the bench checks --models before anything else)."""
    from kvcodec.errors import KVCodecError
    from kvcodec.models.check import inspect_model

    try:
        return inspect_model(MODEL)
    except KVCodecError as e:
        pytest.skip(f"model {MODEL} unavailable: {e}")


@pytest.fixture
def no_model_loads(monkeypatch):
    """A refusal must come before any model loads: loading one fails the test."""
    import kvcodec.models

    def load_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(kvcodec.models, "load_model", load_model)


def invoke(*args: str) -> click.testing.Result:
    return CliRunner().invoke(command, list(args))


# ----------------------------------------------------------------------------- options


def test_target_ratios_name_one_transform_method_each():
    assert transform_method_names("5,8") == ["kvcodec-transform-5", "kvcodec-transform-8"]
    names = transform_method_names(" 5, 5.0 ,8.5,")
    assert names == ["kvcodec-transform-5", "kvcodec-transform-8.5"]
    assert [transform_ratio(n) for n in names] == [5.0, 8.5]


@pytest.mark.parametrize("text", ["1", "0.5,5", "5,x", "", ",", "nan", "inf", "-3"])
def test_target_ratios_that_are_not_numbers_above_one_are_refused(text):
    with pytest.raises(click.BadParameter, match="each a number > 1"):
        transform_method_names(text)


@pytest.mark.parametrize("text", ["1.0000001", "5.1234567"])
def test_target_ratios_a_method_name_would_round_are_refused(text):
    with pytest.raises(click.BadParameter, match="6 significant digits"):
        transform_method_names(text)


def test_target_ratios_without_a_transform_is_a_usage_error(no_model_loads):
    res = invoke("--target-ratios", "5")
    assert res.exit_code == 2, res.output
    assert "--target-ratios needs --transform" in res.output


def test_a_missing_kvt_is_refused(no_model_loads, tmp_path):
    res = invoke("--transform", str(tmp_path / "missing.kvt"))
    assert res.exit_code == 2 and "does not exist" in res.output, res.output


def test_a_file_that_is_not_a_kvt_is_refused(model_config, no_model_loads, tmp_path):
    path = tmp_path / "notes.kvt"
    path.write_text("not a calibration\n" * 20)
    res = invoke("--transform", str(path))
    assert res.exit_code == 2 and "not a .kvt" in res.output, res.output


def test_a_kvt_of_another_model_is_warned_of_and_refused_for_its_other_kv_shape(
    model_config, no_model_loads, synthetic_kvt
):
    res = invoke("--transform", str(synthetic_kvt), "--models", MODEL)
    assert res.exit_code == 2, res.output
    assert "calibrated on 'synthetic', the model measured is 'smollm2-135m'" in res.output
    assert "does not match the transform's" in res.output


def test_a_kvt_of_another_kv_shape_is_refused(model_config, no_model_loads, tmp_path):
    from kvcodec.transform import calibrate, save_kvt

    path = tmp_path / "mislabelled.kvt"  # names the model, but fits the synthetic KV's shape
    save_kvt(calibrate([synthetic_kv(600, s) for s in (1, 2)], ROPE, info={"model": MODEL}), path)
    res = invoke("--transform", str(path))
    assert res.exit_code == 2, res.output
    assert "does not match the transform's" in res.output


def test_a_ratio_not_above_one_is_refused_with_a_kvt(model_config, no_model_loads, synthetic_kvt):
    res = invoke("--transform", str(synthetic_kvt), "--models", MODEL, "--target-ratios", "5,1")
    assert res.exit_code == 2 and "--target-ratios" in res.output, res.output


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("tokens", [100, 300])  # shorter than one 256-token chunk; a chunk and a short one
def test_a_transform_round_trip_meets_its_ratio_with_a_small_error(synthetic_kvt, tokens):
    kv = synthetic_kv(tokens, seed=3).float()  # a text the .kvt was not calibrated on
    errors, ratios = [], []
    for method in ("kvcodec-transform-5", "kvcodec-transform-8"):
        codec = chunked_transform_codec(method, synthetic_kvt)
        restored, nbytes, encode_s = restore(kv, method, codec=codec)
        assert restored.shape == kv.shape and restored.dtype == kv.dtype and encode_s > 0
        ratios.append(kv.numel() * 2 / nbytes)
        errors.append(rel_mse(restored, kv))
        assert rel_mse(restored[:, :, -20:], kv[:, :, -20:]) < 1e-3  # the last (short) chunk was decoded too
    assert ratios[0] == pytest.approx(5, rel=0.1) and ratios[1] > 1.3 * ratios[0]
    assert 0 < errors[0] < errors[1] < 1e-3


def test_the_exact_check_leaves_the_lossy_transform_methods_alone():
    exact = {
        "model": MODEL,
        "quant": "exact",
        "round_trips": 2,
        "bit_exact_round_trips": 2,
        "identical_scores": 1,
        "n_questions": 1,
        "accuracy_restored": 1.0,
        "accuracy_recomputed": 1.0,
        "token_agreement": 1.0,
        "ppl_delta": 0.0,
    }
    lossy = {**exact, "quant": "kvcodec-transform-5", "bit_exact_round_trips": 0, "identical_scores": 0}
    lossy |= {"accuracy_restored": 0.0, "token_agreement": 0.5, "ppl_delta": 0.3}
    assert exact_failures([exact, lossy]) == []
    assert exact_failures([{**exact, "token_agreement": 0.5}, lossy])  # exact itself is still checked


# ----------------------------------------------------------------------------- a real model


@pytest.fixture(scope="module")
def smollm2_kvt(smollm2, tmp_path_factory):
    """A transform calibrated on SmolLM2's KV of two essays the test does not score."""
    from kvcodec.integrations.hf import extract_kv
    from kvcodec.models.texts import load_text
    from kvcodec.transform import RopeSpec, calibrate, save_kvt

    model, tok = smollm2
    kvs = [extract_kv(model, tok, load_text(t, max_chars=4000), 400)[1] for t in ("pg/aord", "pg/apple")]
    path = tmp_path_factory.mktemp("kvt") / "smollm2.kvt"
    save_kvt(calibrate(kvs, RopeSpec.from_hf_config(model.config), info={"model": MODEL}), path)
    return path


@pytest.mark.slow
def test_a_real_model_run_records_the_transform_method_like_a_quant(smollm2, smollm2_kvt, monkeypatch):
    """A question and an essay after SmolLM2's KV of 300 tokens (a chunk and a short one) restored
    through exact and through the transform at 5x: recorded and tabled side by side."""
    import kvcodec.models
    from kvbench.accuracy import ModelRun
    from kvbench.results import machine
    from kvcodec.models.texts import MultipleChoiceQuestion, load_text

    monkeypatch.setattr(kvcodec.models, "load_model", lambda name: smollm2)
    methods = ["exact", "kvcodec-transform-5"]
    run = ModelRun(MODEL, methods, "minute_mysteries", "float32", False, lambda msg: None, 12, smollm2_kvt)
    essay = load_text("pg/addiction", max_chars=3000)
    q = MultipleChoiceQuestion("handmade/0", essay, "What is the essay about?", ("addiction", "boats", "music"), 0)
    row = run.question(q, 300)
    run.perplexity("pg/addiction", 300, 16, 8)
    settings = {"ppl_texts": ["pg/addiction"], "ppl_prefix_tokens": 300, "ppl_scored_tokens": 15, "greedy_tokens": 8}
    exact, coded = (run.record(m, 1, settings) for m in methods)
    assert row["doc_tokens"] == 300 and set(row["choices_restored"]) == set(methods)
    assert exact["ppl_delta"] == 0.0 and exact["token_agreement"] == 1.0 and exact_failures([exact, coded]) == []
    assert coded["quant"] == "kvcodec-transform-5" and coded["target_ratio"] == 5.0 and coded["round_trips"] == 2
    assert coded["codec"].startswith("transform") and coded["chunk_tokens"] == 256 and coded["kvt_sha256"]
    assert coded["ratio_vs_fp16"] == pytest.approx(5, rel=0.15) and exact["ratio_vs_fp16"] < 2
    assert 0 < coded["kv_rel_rms_error"] < 0.5 and coded["bit_exact_round_trips"] == 0
    assert coded["ppl_delta"] != 0.0 and abs(coded["ppl_delta"]) < 0.5 * coded["ppl_recomputed"]
    doc = {
        "machine": machine() | {"device": "cpu"},
        "command": "kvcodec bench accuracy --transform smollm2.kvt",
        "settings": {"kv_dtype": "float32", "greedy_tokens": 8, "transform": "smollm2.kvt"}
        | {"transform_chunk_tokens": 256},
        "records": [exact, coded],
    }
    md = "\n".join(table(doc))
    assert f"| {MODEL} | kvcodec-transform-5 | minute_mysteries |" in md
    assert f"| {coded['ratio_vs_fp16']:.2f} |" in md and "kvcodec-transform-<r>: the transform codec" in md
