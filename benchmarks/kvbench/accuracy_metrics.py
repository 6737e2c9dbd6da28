"""Accuracy of a restored prefix KV against the recomputed one, measured with a real model.

Conventions: a prefix KV covers ``prefix_ids`` exactly (see kvcodec.integrations.hf); tokens after
the prefix are computed fresh on top of it. The logits of the last prefix position are not part of
a KV, so the first token after the prefix is never scored: perplexity is over continuation[1:], and
greedy decoding and question answering start from a short fresh "prompt" / "suffix".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from kvcodec.errors import ConfigError, ShapeError
from kvcodec.integrations.hf import continue_from_kv, greedy_from_kv

DEFAULT_GREEDY_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    ppl_reference: float
    ppl_restored: float
    n_tokens: int  # tokens scored

    @property
    def delta(self) -> float:
        """ppl_restored - ppl_reference (0 for a lossless restore)."""
        return self.ppl_restored - self.ppl_reference


@dataclasses.dataclass(frozen=True)
class AgreementResult:
    tokens_reference: tuple[int, ...]
    tokens_restored: tuple[int, ...]

    @property
    def agreement(self) -> float:
        """Fraction of positions where both greedy decodes chose the same token."""
        n = len(self.tokens_reference)
        return sum(a == b for a, b in zip(self.tokens_reference, self.tokens_restored)) / n if n else 1.0

    @property
    def first_divergence(self) -> int | None:
        """Index of the first differing token, None if the sequences are identical."""
        for i, (a, b) in enumerate(zip(self.tokens_reference, self.tokens_restored)):
            if a != b:
                return i
        return None


@dataclasses.dataclass(frozen=True)
class ChoiceResult:
    scores: tuple[float, ...]  # log-likelihood per option (see score_options for normalisation)
    choice: int  # argmax of scores
    answer: int | None = None  # the right option, when known

    @property
    def correct(self) -> bool:
        return self.answer is not None and self.choice == self.answer


def _ids(x: Any) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.long)
    return t.reshape(-1)


def continuation_logprobs(model: Any, prefix_ids: Any, kv: torch.Tensor, continuation_ids: Any) -> torch.Tensor:
    """log p(continuation[j] | prefix, continuation[:j]) for j = 1 .. n-1 (float64, shape [n-1])."""
    cont = _ids(continuation_ids)
    if cont.numel() < 2:
        raise ShapeError(f"a continuation needs at least 2 tokens to score; got {cont.numel()}")
    out = continue_from_kv(model, prefix_ids, kv, cont)
    logp = torch.log_softmax(out.logits[0, :-1].double(), dim=-1)
    return logp.gather(1, cont[1:].to(logp.device).unsqueeze(1)).squeeze(1).cpu()


def perplexity(model: Any, prefix_ids: Any, kv: torch.Tensor, continuation_ids: Any) -> float:
    """Perplexity of continuation[1:] given the prefix (as its KV) and continuation[0]."""
    lp = continuation_logprobs(model, prefix_ids, kv, continuation_ids)
    return math.exp(-float(lp.mean()))


def perplexity_delta(
    model: Any, prefix_ids: Any, kv_restored: torch.Tensor, kv_reference: torch.Tensor, continuation_ids: Any
) -> PerplexityResult:
    """Perplexity of the same continuation after the restored and the reference (recomputed) KV."""
    ref = perplexity(model, prefix_ids, kv_reference, continuation_ids)
    got = perplexity(model, prefix_ids, kv_restored, continuation_ids)
    return PerplexityResult(ref, got, _ids(continuation_ids).numel() - 1)


def greedy_agreement(
    model: Any,
    prefix_ids: Any,
    kv_restored: torch.Tensor,
    kv_reference: torch.Tensor,
    prompt_ids: Any,
    n_tokens: int = DEFAULT_GREEDY_TOKENS,
) -> AgreementResult:
    """Greedy-decode n_tokens after prefix + prompt with each KV; compare the two token sequences."""
    if n_tokens < 1:
        raise ConfigError(f"n_tokens must be >= 1; got {n_tokens}")
    ref = greedy_from_kv(model, prefix_ids, kv_reference, _ids(prompt_ids), n_tokens)
    got = greedy_from_kv(model, prefix_ids, kv_restored, _ids(prompt_ids), n_tokens)
    return AgreementResult(tuple(ref), tuple(got))


def score_options(
    model: Any,
    prefix_ids: Any,
    kv: torch.Tensor,
    suffix_ids: Any,
    options_ids: Sequence[Any],
    *,
    normalize: bool = False,
) -> tuple[float, ...]:
    """Log-likelihood of each option's tokens after prefix (its KV) + suffix (computed fresh).

    normalize: divide by the option's token count (mean log-probability per token).
    """
    suffix = _ids(suffix_ids)
    if suffix.numel() < 1:
        raise ShapeError("the suffix needs at least one token (the prefix KV carries no logits)")
    if not options_ids:
        raise ConfigError("no options to score")
    scores = []
    for opt in options_ids:
        o = _ids(opt)
        if o.numel() == 0:
            raise ShapeError("an option tokenizes to no tokens")
        lp = continuation_logprobs(model, prefix_ids, kv, torch.cat([suffix, o]))
        s = float(lp[-o.numel() :].sum())
        scores.append(s / o.numel() if normalize else s)
    return tuple(scores)


# ----------------------------------------------------------------------------- multiple-choice QA

DOCUMENT_TEMPLATE = "Story: {document}\n"
SUFFIX_TEMPLATE = "Question: {question}\nAnswer:"
OPTION_TEMPLATE = " {option}"


def _tok(tokenizer: Any, text: str, special: bool) -> torch.Tensor:
    return torch.as_tensor(tokenizer(text, add_special_tokens=special).input_ids, dtype=torch.long)


def document_ids(tokenizer: Any, question: Any, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids of a question's document prefix (the part whose KV is stored and reused).

    max_tokens keeps the document's LAST tokens (the end of a mystery holds the clues that matter).
    """
    ids = _tok(tokenizer, DOCUMENT_TEMPLATE.format(document=question.document), True)
    if max_tokens is not None and ids.numel() > max_tokens:
        ids = ids[-max_tokens:]
    return ids


def answer_multiple_choice(
    model: Any,
    tokenizer: Any,
    prefix_ids: Any,
    kv: torch.Tensor,
    question: Any,
    *,
    normalize: bool = False,
) -> ChoiceResult:
    """Score a MultipleChoiceQuestion's options after its document prefix KV; pick the best."""
    suffix = _tok(tokenizer, SUFFIX_TEMPLATE.format(question=question.question), False)
    options = [_tok(tokenizer, OPTION_TEMPLATE.format(option=o), False) for o in question.options]
    scores = score_options(model, prefix_ids, kv, suffix, options, normalize=normalize)
    choice = max(range(len(scores)), key=scores.__getitem__)
    return ChoiceResult(scores, choice, getattr(question, "answer", None))


def kv_error(kv_restored: torch.Tensor, kv_reference: torch.Tensor) -> dict[str, float]:
    """max |error|, RMS error and RMS error relative to the reference's RMS."""
    if kv_restored.shape != kv_reference.shape:
        raise ShapeError(
            f"KV shapes differ: restored {tuple(kv_restored.shape)}, reference {tuple(kv_reference.shape)}"
        )
    d = kv_restored.double() - kv_reference.double()
    rms = float(d.pow(2).mean().sqrt())
    ref_rms = float(kv_reference.double().pow(2).mean().sqrt())
    return {"max_abs": float(d.abs().max()), "rms": rms, "rel_rms": rms / ref_rms if ref_rms else 0.0}


@dataclasses.dataclass(frozen=True)
class ExtractiveResult:
    text: str  # the greedy answer, first line, stripped
    tokens: tuple[int, ...]
    exact_match: bool  # equals one of the accepted answers after normalisation
    f1: float  # best token-overlap F1 against the accepted answers


def normalize_answer(text: str) -> list[str]:
    """SQuAD-style normalisation: lower case, punctuation and articles dropped, split on spaces."""
    import re
    import string

    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def answer_f1(prediction: str, answers: Sequence[str]) -> tuple[bool, float]:
    """(exact match, F1) of a predicted answer against any of the accepted ones."""
    pred = normalize_answer(prediction)
    best_em, best_f1 = False, 0.0
    for ans in answers:
        gold = normalize_answer(ans)
        best_em = best_em or pred == gold
        common = sum(min(pred.count(w), gold.count(w)) for w in set(pred))
        if common:
            p, r = common / len(pred), common / len(gold)
            best_f1 = max(best_f1, 2 * p * r / (p + r))
        elif pred == gold:
            best_f1 = 1.0
    return best_em, best_f1


def answer_extractive(
    model: Any, tokenizer: Any, prefix_ids: Any, kv: torch.Tensor, question: Any, max_new_tokens: int = 12
) -> ExtractiveResult:
    """Greedy-answer an ExtractiveQuestion after its document prefix KV; score it against the spans."""
    suffix = _tok(tokenizer, SUFFIX_TEMPLATE.format(question=question.question), False)
    tokens = greedy_from_kv(model, prefix_ids, kv, suffix, max_new_tokens)
    text = tokenizer.decode(tokens, skip_special_tokens=True).strip().split("\n")[0].strip()
    em, f1 = answer_f1(text, question.answers)
    return ExtractiveResult(text, tuple(tokens), em, f1)
