"""Accuracy helpers: pure result arithmetic, and real-model checks against full recomputation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench import accuracy_metrics as acc
from kvcodec.errors import ShapeError
from kvcodec.integrations.hf import extract_kv, forward_ids
from kvcodec.models.texts import MultipleChoiceQuestion

# ----------------------------------------------------------------------------- pure


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=40))
def test_agreement_counts_equal_positions(pairs):
    ref, got = zip(*pairs)
    r = acc.AgreementResult(tuple(ref), tuple(got))
    equal = [a == b for a, b in pairs]
    assert r.agreement == pytest.approx(sum(equal) / len(pairs))
    assert r.first_divergence == (None if all(equal) else equal.index(False))


def test_perplexity_result_delta():
    assert acc.PerplexityResult(10.0, 10.5, 7).delta == pytest.approx(0.5)
    assert acc.PerplexityResult(3.0, 3.0, 7).delta == 0.0


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**16), st.floats(1e-3, 1.0))
def test_kv_error(seed, scale):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(2, 2, 5, 3, 4, generator=g)
    got = ref + torch.randn(ref.shape, generator=g) * scale
    diff = got.double() - ref.double()  # the error as stored (after float32 rounding)
    e = acc.kv_error(got, ref)
    assert e["max_abs"] == pytest.approx(float(diff.abs().max()), rel=1e-9)
    assert e["rms"] == pytest.approx(float(diff.pow(2).mean().sqrt()), rel=1e-9)
    assert e["rel_rms"] == pytest.approx(e["rms"] / float(ref.double().pow(2).mean().sqrt()), rel=1e-9)
    assert acc.kv_error(ref, ref) == {"max_abs": 0.0, "rms": 0.0, "rel_rms": 0.0}
    with pytest.raises(ShapeError):
        acc.kv_error(ref[:, :, :4], ref)


# ----------------------------------------------------------------------------- real models


def _noisy(kv: torch.Tensor, rel: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return kv + torch.randn(kv.shape, generator=g) * kv.std() * rel


@pytest.mark.slow
def test_perplexity_matches_full_forward_pass(real_model, short_text):
    name, model, tok = real_model
    ids = tok(short_text, return_tensors="pt").input_ids[0][:96]
    P = 64
    _, kv = extract_kv(model, tok, short_text, max_tokens=P)
    ppl = acc.perplexity(model, ids[:P], kv, ids[P:])
    logits, _ = forward_ids(model, ids)
    logp = torch.log_softmax(logits[P:-1].double(), -1).gather(1, ids[P + 1 :, None]).squeeze(1)
    assert ppl == pytest.approx(math.exp(-float(logp.mean())), rel=1e-4)
    assert 1.0 < ppl < 1000.0

    same = acc.perplexity_delta(model, ids[:P], kv.clone(), kv, ids[P:])
    assert same.delta == 0.0 and same.n_tokens == 96 - P - 1
    noisy = acc.perplexity_delta(model, ids[:P], _noisy(kv, 1.0), kv, ids[P:])
    assert noisy.delta != 0.0


@pytest.mark.slow
def test_greedy_agreement_identical_and_damaged(real_model, short_text):
    name, model, tok = real_model
    ids, kv = extract_kv(model, tok, short_text, max_tokens=48)
    prompt = tok(" In short,", add_special_tokens=False).input_ids
    same = acc.greedy_agreement(model, ids, kv.clone(), kv, prompt, n_tokens=12)
    assert same.agreement == 1.0 and same.first_divergence is None
    assert len(same.tokens_reference) == 12
    wrecked = torch.randn(kv.shape, generator=torch.Generator().manual_seed(1)) * kv.abs().max()
    bad = acc.greedy_agreement(model, ids, wrecked, kv, prompt, n_tokens=12)
    assert bad.tokens_reference == same.tokens_reference
    assert bad.agreement < 1.0


@pytest.mark.slow
def test_multiple_choice_scores_equal_recomputation(real_model):
    name, model, tok = real_model
    q = MultipleChoiceQuestion(
        id="handmade/0",
        document="Anna keeps her bicycle in the red shed. Ben keeps his car in the garage. "
        "Carla keeps her boat at the lake.",
        question="Where does Ben keep his car?",
        options=("in the garage", "in the red shed", "at the lake"),
        answer=0,
    )
    doc = acc.document_ids(tok, q)
    _, kv = extract_kv(model, tok, acc.DOCUMENT_TEMPLATE.format(document=q.document))
    res = acc.answer_multiple_choice(model, tok, doc, kv, q)
    assert len(res.scores) == 3 and all(s < 0 for s in res.scores)
    # same scores from one uninterrupted pass over document + suffix + option
    suffix = tok(acc.SUFFIX_TEMPLATE.format(question=q.question), add_special_tokens=False).input_ids
    for i, opt in enumerate(q.options):
        o = tok(acc.OPTION_TEMPLATE.format(option=opt), add_special_tokens=False).input_ids
        full = torch.cat([doc, torch.tensor(suffix + o)])
        logits, _ = forward_ids(model, full)
        n = len(o)
        lp = torch.log_softmax(logits[-n - 1 : -1].double(), -1).gather(1, full[-n:, None]).sum()
        assert res.scores[i] == pytest.approx(float(lp), abs=1e-3)
    # a restored copy gives bit-identical scores
    assert acc.answer_multiple_choice(model, tok, doc, kv.clone(), q).scores == res.scores
    assert res.correct == (res.choice == 0)


@pytest.mark.slow
def test_score_options_needs_a_suffix(smollm2, short_text):
    model, tok = smollm2
    ids, kv = extract_kv(model, tok, short_text, max_tokens=8)
    with pytest.raises(ShapeError, match="suffix"):
        acc.score_options(model, ids, kv, [], [[5]])


# ----------------------------------------------------------------------------- the bench command


def test_exact_failures_flags_any_difference():
    from kvbench.accuracy import exact_failures

    ok = {
        "model": "m",
        "quant": "exact",
        "n_questions": 3,
        "identical_scores": 3,
        "accuracy_restored": 0.5,
        "accuracy_recomputed": 0.5,
        "token_agreement": 1.0,
        "ppl_delta": 0.0,
    }
    assert exact_failures([ok, {**ok, "quant": "int4", "identical_scores": 0}]) == []
    assert exact_failures([{**ok, "identical_scores": 2}])
    assert exact_failures([{**ok, "token_agreement": 0.98}])
    assert exact_failures([{**ok, "ppl_delta": 1e-9}])
    ok2 = {**ok, "round_trips": 4, "bit_exact_round_trips": 4, "stored_dtype_is_model_dtype": False}
    assert exact_failures([{**ok2, "ppl_delta": 0.01, "identical_scores": 0}]) == []  # fp16 storage of fp32 KV
    assert exact_failures([{**ok2, "bit_exact_round_trips": 3}])


@pytest.mark.slow
def test_bench_accuracy_command_end_to_end(smollm2, tmp_path):
    """A tiny real run through the codec: exact reproduces the recomputation; files are written."""
    import json

    from click.testing import CliRunner

    from kvbench.accuracy import command
    from kvcodec.errors import ConfigError
    from kvcodec.models.texts import ensure_bigbench

    try:
        ensure_bigbench()
    except ConfigError as e:
        pytest.skip(str(e))
    args = [
        "--n-questions",
        "1",
        "--max-doc-tokens",
        "48",
        "--quants",
        "exact,int4",
        "--ppl-prefix",
        "32",
        "--ppl-tokens",
        "8",
        "--greedy-tokens",
        "4",
        "--ppl-texts",
        "pg/addiction",
        "--out-dir",
        str(tmp_path),
        "--tag",
        "test",
    ]
    res = CliRunner().invoke(command, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    doc = json.loads((tmp_path / "accuracy-smollm2-135m-test.json").read_text())
    assert doc["command"].startswith("kvcodec bench accuracy --quants exact,int4 --n-questions 1 ")
    assert doc["machine"]["device"] == "cpu" and doc["exact_reproduces_recomputation"] is True
    exact, int4 = doc["records"]
    assert exact["quant"] == "exact" and int4["quant"] == "int4"
    for key in (
        "model",
        "quant",
        "task",
        "n_questions",
        "accuracy_restored",
        "accuracy_recomputed",
        "ppl_delta",
        "token_agreement",
    ):
        assert key in exact
    assert exact["ppl_delta"] == 0.0 and exact["token_agreement"] == 1.0 and exact["identical_scores"] == 1
    assert exact["bit_exact_round_trips"] == exact["round_trips"] == 2 and int4["bit_exact_round_trips"] == 0
    assert int4["kv_rel_rms_error"] > 0 and int4["ratio_vs_fp16"] > exact["ratio_vs_fp16"]
    assert doc["per_question"][0]["doc_tokens"] == 48
    assert (tmp_path / "accuracy-smollm2-135m-test.md").read_text().count("| smollm2-135m |") == 2


def test_extractive_answer_scoring_follows_squad_normalisation():
    from kvbench.accuracy_metrics import answer_f1, normalize_answer

    assert normalize_answer("The  Beatles!") == ["beatles"]
    assert answer_f1("the Beatles.", ["Beatles"]) == (True, 1.0)
    em, f1 = answer_f1("Catherine Hickson", ["Catherine"])
    assert not em and abs(f1 - 2 / 3) < 1e-9
    assert answer_f1("Warlock", ["Heseltine"]) == (False, 0.0)
    assert answer_f1("x", ["nope", "x"]) == (True, 1.0)  # any accepted span counts
