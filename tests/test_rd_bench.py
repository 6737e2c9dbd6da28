"""benchmarks/rd_tasks.py: answer cutting, same-answer normalisation, F1, needle placement and
scoring (pure, hypothesis), task aggregation, and the chat-template split on a real tokenizer."""

from __future__ import annotations

import string
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import rd_tasks  # noqa: E402

words = st.lists(st.text(string.ascii_letters + string.digits, min_size=1, max_size=8), min_size=1, max_size=6)
sentences = st.lists(
    st.builds(lambda ws, end: " ".join(ws) + end, words, st.sampled_from([".", "!", "?"])), min_size=1, max_size=12
)


# ----------------------------------------------------------------------------- answers


@pytest.mark.parametrize(
    "raw, cut",
    [
        (" Catherine\nQuestion: who", "Catherine"),
        ("\n\nAnswer: John Cassidy.", "John Cassidy"),
        ('"Mount St. Helens"', "Mount St. Helens"),
        ("", ""),
        ("a: 42", "42"),
    ],
)
def test_cut_answer(raw, cut):
    assert rd_tasks.cut_answer(raw) == cut


@settings(max_examples=100, deadline=None)
@given(words, st.sampled_from(["", ".", "!", " ", "\n"]), st.booleans())
def test_same_answer_ignores_case_punctuation_articles(ws, tail, upper):
    text = " ".join(ws)
    variant = ("The " + text + tail).upper() if upper else "the " + text + tail
    assert rd_tasks.same_answer(text, variant)
    assert rd_tasks.same_answer(variant, text)


@settings(max_examples=100, deadline=None)
@given(words, words)
def test_same_answer_is_token_equality(a, b):
    sa, sb = " ".join(a), " ".join(b)
    na = [w.lower() for w in a if w.lower() not in ("a", "an", "the")]
    nb = [w.lower() for w in b if w.lower() not in ("a", "an", "the")]
    assert rd_tasks.same_answer(sa, sb) == (na == nb)


@settings(max_examples=100, deadline=None)
@given(words, words)
def test_f1_bounds_and_symmetry(a, b):
    sa, sb = " ".join(a), " ".join(b)
    f = rd_tasks.best_f1(sa, [sb])
    assert 0.0 <= f <= 1.0
    assert f == pytest.approx(rd_tasks.best_f1(sb, [sa]))
    assert rd_tasks.best_f1(sa, [sa]) == 1.0
    assert rd_tasks.best_f1(sa, [sb, sa]) == 1.0  # the best of the accepted answers counts


def test_f1_partial_overlap():
    assert rd_tasks.best_f1("John Cassidy", ["Cassidy"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert rd_tasks.best_f1("Hickson", ["Catherine"]) == 0.0


# ----------------------------------------------------------------------------- needle


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 10**9),
    st.text(string.ascii_letters + " .:", max_size=20),
    st.text(string.ascii_letters + " .:", max_size=20),
)
def test_needle_hit_finds_the_whole_number(code, before, after):
    c = str(code)
    assert rd_tasks.needle_hit(f"{before} {c}{after}", c)
    assert not rd_tasks.needle_hit(f"{before} 7{c}{after}", c)
    assert not rd_tasks.needle_hit(f"{before} {c}3{after}", c)


def test_needle_hit_thousands_separator():
    assert rd_tasks.needle_hit("The code is 481,207.", "481207")
    assert not rd_tasks.needle_hit("The code is 48120.", "481207")


@settings(max_examples=200, deadline=None)
@given(sentences, st.floats(0.0, 1.0))
def test_insert_at_depth_places_needle_once_at_a_sentence_boundary(sents, depth):
    text, needle = " ".join(sents), "The secret code of the blue vault is 123456."
    out, pos = rd_tasks.insert_at_depth(text, needle, depth)
    assert out.count(needle) == 1
    assert out.replace(needle + " ", "", 1) == text or out.replace(" " + needle, "", 1) == text
    assert pos in (0, len(text)) or text[pos - 2] in ".!?"
    # nearest boundary: no other boundary is closer to the asked depth
    bounds = [0, len(text)] + [i + 1 for i in range(len(text) - 1) if text[i] == " " and text[i - 1] in ".!?"]
    target = depth * len(text)
    assert abs(pos - target) <= min(abs(b - target) for b in bounds) + 1e-9


def test_insert_at_depth_ends_and_errors():
    text = "One. Two. Three."
    assert rd_tasks.insert_at_depth(text, "N.", 0.0) == ("N. " + text, 0)
    assert rd_tasks.insert_at_depth(text, "N.", 1.0) == (text + " N.", len(text))
    assert rd_tasks.insert_at_depth(text, "N.", 0.3)[0] == "One. N. Two. Three."
    assert rd_tasks.insert_at_depth(text, "N.", 0.6)[0] == "One. Two. N. Three."
    with pytest.raises(ValueError):
        rd_tasks.insert_at_depth(text, "N.", 1.5)


# ----------------------------------------------------------------------------- aggregation


def _row(task, same, score, ref_score, size=100):
    m = dict(answer="x", same=same, same_tokens=same, score=score, bytes=size)
    return dict(task=task, id="i", score_recomputed=ref_score, values=100, methods={"m": m})


def test_task_fields_aggregate_per_task():
    rows = [_row("quoref", True, 1.0, 1.0), _row("quoref", False, 0.0, 0.5), _row("needle", True, 1.0, 1.0, 40)]
    f = rd_tasks.task_fields(rows, "m")
    assert f["quoref_n"] == 2 and f["needle_n"] == 1
    assert f["same_answer_rate"] == f["quoref_same_answer_rate"] == 0.5
    assert f["f1"] == f["quoref_f1_restored"] == 0.5
    assert f["quoref_f1_recomputed"] == 0.75
    assert f["quoref_ratio_vs_fp16_zstd_path"] == 2.0 and f["needle_ratio_vs_fp16_zstd_path"] == 5.0
    assert f["needle_retrieval_restored"] == 1.0
    assert rd_tasks.task_fields([], "m") == {}
    no_bytes = [_row("quoref", True, 1.0, 1.0, None)]
    assert "quoref_ratio_vs_fp16_zstd_path" not in rd_tasks.task_fields(no_bytes, "m")


# ----------------------------------------------------------------------------- real tokenizer


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from kvcodec.errors import ConfigError
    from kvcodec.models import load_model
    from kvcodec.models.registry import model_cache_path

    folder = model_cache_path("smollm2-135m")
    if not (folder / "tokenizer_config.json").is_file():
        try:
            load_model("smollm2-135m")  # converts and caches the model once
        except ConfigError as e:
            pytest.skip(f"smollm2-135m unavailable: {e}")
    return AutoTokenizer.from_pretrained(str(folder))


def test_chat_split_is_the_chat_prompt(smol_tokenizer):
    tok = smol_tokenizer
    head, tail = "Passage: Ann met Bob in Paris.", "\n\nQuestion: Who met Bob?"
    prefix, suffix = rd_tasks.chat_split(tok, head, tail)
    full = tok.apply_chat_template(
        [{"role": "user", "content": head + tail}], tokenize=False, add_generation_prompt=True
    )
    assert tok.decode(torch.cat([prefix, suffix])) == full
    assert tok.decode(prefix).endswith("Paris.") and "Question" not in tok.decode(prefix)


def test_needle_prompts_hold_their_code_and_skip_calibration_essays(smol_tokenizer):
    ps = rd_tasks.needle_prompts(smol_tokenizer, [600], [0.0, 0.5, 1.0])
    assert len(ps) == 3 and len({p.gold for p in ps}) == 3
    for p in ps:
        text = smol_tokenizer.decode(p.prefix)
        assert text.count(p.gold[0]) == 1
        assert 550 <= p.prefix.numel() <= 700
    from kvcodec.models.texts import load_text

    openings = [load_text(e).strip()[:60] for e in rd_tasks.CALIBRATION_ESSAYS]
    assert all(len(o) == 60 for o in openings)
    assert not any(o in smol_tokenizer.decode(p.prefix) for o in openings for p in ps)


def test_generate_like_matches_generate(smollm2):
    from kvcodec.integrations.hf import cache_to_tensor, forward_ids

    model, tok = smollm2
    prefix, suffix = rd_tasks.chat_split(
        tok, "Passage: Ann met Bob in Paris. Bob gave Ann a red book.", "\n\nQuestion: Who gave Ann a book?"
    )
    kv = cache_to_tensor(forward_ids(model, prefix)[1])
    ref = rd_tasks.generate(model, tok, prefix, kv, suffix, 12)
    assert ref and rd_tasks.generate_like(model, tok, prefix, kv, suffix, ref, 12) == ref
    torch.manual_seed(0)
    for scale in (0.3, 3.0):
        noisy = kv + scale * kv.std() * torch.randn_like(kv)
        want = rd_tasks.generate(model, tok, prefix, noisy, suffix, 12)
        assert rd_tasks.generate_like(model, tok, prefix, noisy, suffix, ref, 12) == want
    assert rd_tasks.generate_like(model, tok, prefix, kv, suffix, ref[:-1] + (ref[-1] + 1,), 12) == ref


def test_rd_checks_its_inputs_before_the_model_loads(tmp_path, synthetic_kvt):
    # a .kvt of another shape failed after the model had loaded and the fp16 method had run (40-line
    # traceback); --out's folder after all the measuring; --kvt skipped the calibration-leak check
    import click

    import rd
    from kvcodec.errors import ShapeError

    out = str(tmp_path / "rd")
    with pytest.raises(ShapeError, match="does not match the transform"):
        rd.check_before_the_work("smollm2-135m", ["pg/want"], "pg/apple", None, str(synthetic_kvt), out)
    with pytest.raises(click.BadParameter, match="pg/apple: calibrated on"):
        rd.check_before_the_work("smollm2-135m", ["pg/apple"], "pg/apple,pg/avg", None, None, out)
    with pytest.raises(click.BadParameter, match="does not exist"):
        rd.check_before_the_work("smollm2-135m", ["pg/want"], "pg/apple", None, None, str(tmp_path / "no" / "rd"))
    rd.check_before_the_work("smollm2-135m", ["pg/want"], "pg/apple", None, None, out)
