"""Task accuracy of a restored prefix KV against recomputation, for benchmarks/rd.py.

Two tasks, both prompted through the model's chat template, the stored prefix being everything up
to the end of the long text (template head, instruction, passage / haystack) and the question
computed fresh on top of it:

- Quoref (bigbench natural_instructions subtask002): one question per distinct passage; the
  greedy answer, cut at its first line, is compared with the answer the recomputed KV gives
  (same-answer rate, after SQuAD normalisation) and with the gold spans (token F1);
- needle retrieval: a sentence carrying a number, placed at a depth of a 2k-4k-token haystack of
  Paul Graham essays (never the calibration essays); retrieved when the answer holds the number.

The pure scoring and placement functions come first; the model-facing code after them.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvbench.accuracy_metrics import answer_f1, normalize_answer
from kvcodec.cli.calibrate import DEFAULT_TEXTS

QUOREF_INSTRUCTION = "Read the passage, then answer the question with a short span copied from the passage.\n\n"
QUOREF_QUESTION = "\n\nQuestion: {question}\nAnswer with the span only."
NEEDLE_INSTRUCTION = "Read the following essays carefully. A secret code is hidden somewhere in them.\n\n"
NEEDLE_TEXT = "The secret code of the {color} vault is {code}."
NEEDLE_QUESTION = "\n\nQuestion: What is the secret code of the {color} vault? Answer with the number only."
COLORS = ("blue", "green", "amber", "violet", "crimson", "silver", "golden", "orange", "teal")
# every essay `kvcodec calibrate --model M` fits on by default (the first 4 were the default before): never a haystack
CALIBRATION_ESSAYS = tuple(DEFAULT_TEXTS)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


# ----------------------------------------------------------------------------- pure scoring


def cut_answer(text: str) -> str:
    """The answer part of a generation: its first non-empty line, an 'Answer:' label and a final
    period dropped, surrounding quotes and spaces stripped."""
    line = next((ln for ln in text.splitlines() if ln.strip()), "").strip()
    line = re.sub(r"^(answer|a)\s*:\s*", "", line, flags=re.IGNORECASE)
    return line.strip().rstrip(".").strip().strip("\"'\u201c\u201d").strip()


def same_answer(a: str, b: str) -> bool:
    """Two answers are the same when their SQuAD-normalised token lists are equal."""
    return normalize_answer(a) == normalize_answer(b)


def best_f1(prediction: str, golds: Sequence[str]) -> float:
    return answer_f1(prediction, golds)[1]


def needle_hit(answer: str, code: str) -> bool:
    """Retrieved: the code appears in the answer as a whole number (not inside a longer one)."""
    return re.search(rf"(?<!\d){re.escape(code)}(?!\d)", answer.replace(",", "")) is not None


def insert_at_depth(text: str, needle: str, depth: float) -> tuple[str, int]:
    """(text with `needle` inserted at the sentence boundary nearest depth * len(text), that
    boundary's character offset). Depth 0 puts it first, 1 last; the text is otherwise unchanged."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1]; got {depth}")
    bounds = sorted({0, len(text), *(m.end() for m in _SENTENCE_END.finditer(text))})
    pos = min(bounds, key=lambda b: (abs(b - depth * len(text)), b))
    if pos == 0:
        return needle + " " + text, 0
    if pos == len(text):
        return text + " " + needle, pos
    return text[:pos] + needle + " " + text[pos:], pos


# ----------------------------------------------------------------------------- prompts


@dataclasses.dataclass(frozen=True)
class TaskPrompt:
    """One item: `prefix` (the stored KV's token ids) and `suffix` (computed fresh) as token ids."""

    task: str  # "quoref" | "needle"
    id: str
    prefix: Any  # 1-D LongTensor
    suffix: Any
    gold: tuple[str, ...]  # accepted answers (quoref) or the code (needle)
    meta: dict = dataclasses.field(default_factory=dict)


def chat_split(tokenizer: Any, head: str, tail: str) -> tuple[Any, Any]:
    """Token ids of a one-turn chat prompt whose user message is head + tail, split where head
    ends: (prefix ids, suffix ids). The template's own text is tokenized as given (no extra BOS)."""
    import torch

    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": head + tail}], tokenize=False, add_generation_prompt=True
    )
    cut = full.index(head) + len(head)

    def ids(s: str) -> torch.Tensor:
        return torch.as_tensor(tokenizer(s, add_special_tokens=False).input_ids, dtype=torch.long)

    return ids(full[:cut]), ids(full[cut:])


def quoref_prompts(tokenizer: Any, n: int, max_tokens: int, load: Callable | None = None) -> list[TaskPrompt]:
    """The first n Quoref questions with distinct passages whose prefix fits max_tokens."""
    from kvcodec.models.texts import load_extractive

    seen, out = set(), []
    for q in (load or load_extractive)("quoref"):
        if len(out) >= n:
            break
        if q.document in seen:
            continue
        seen.add(q.document)
        prefix, suffix = chat_split(
            tokenizer, QUOREF_INSTRUCTION + "Passage: " + q.document, QUOREF_QUESTION.format(question=q.question)
        )
        if prefix.numel() <= max_tokens:
            out.append(TaskPrompt("quoref", q.id, prefix, suffix, q.answers, {"prefix_tokens": prefix.numel()}))
    return out


def haystack(tokenizer: Any, essays: Sequence[str], tokens: int, load_text: Callable[[str], str]) -> str:
    """About `tokens` tokens of the essays joined in the given order, cut at a sentence end."""
    parts, total = [], 0
    for name in essays:
        text = load_text(name)
        parts.append(text)
        total += len(tokenizer(text, add_special_tokens=False).input_ids)
        if total >= tokens:
            break
    ids = tokenizer("\n\n".join(parts), add_special_tokens=False).input_ids[:tokens]
    text = tokenizer.decode(ids)
    ends = [m.start() for m in _SENTENCE_END.finditer(text)]
    return text[: ends[-1] + 1] if ends else text


def needle_prompts(
    tokenizer: Any,
    lengths: Iterable[int],
    depths: Iterable[float],
    *,
    exclude: Iterable[str] = CALIBRATION_ESSAYS,
    seed: int = 0,
) -> list[TaskPrompt]:
    """One needle case per (length, depth); each length its own essays, each case its own code."""
    from kvcodec.models.texts import list_texts, load_text

    banned = set(exclude)
    essays = [t for t in list_texts()[1:] if t not in banned]
    rng = random.Random(seed)
    out = []
    for li, length in enumerate(lengths):
        start = (li * 7) % len(essays)
        hay = haystack(tokenizer, essays[start:] + essays[:start], length, load_text)
        for depth in depths:
            color, code = COLORS[len(out) % len(COLORS)], str(rng.randrange(10_000, 1_000_000))
            text, _ = insert_at_depth(hay, NEEDLE_TEXT.format(color=color, code=code), depth)
            prefix, suffix = chat_split(tokenizer, NEEDLE_INSTRUCTION + text, NEEDLE_QUESTION.format(color=color))
            meta = {"length": length, "depth": depth, "prefix_tokens": prefix.numel()}
            out.append(TaskPrompt("needle", f"needle/{length}/{depth:g}", prefix, suffix, (code,), meta))
    return out


# ----------------------------------------------------------------------------- answering


def stop_ids(tokenizer: Any) -> set[int]:
    ids = {tokenizer.eos_token_id}
    for tok in ("<|im_end|>", "<|endoftext|>"):
        i = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.add(i)
    return {i for i in ids if i is not None}


def generate(model: Any, tokenizer: Any, prefix: Any, kv: Any, suffix: Any, max_new: int) -> tuple[int, ...]:
    """Greedy tokens after prefix (as its KV) + suffix, stopping at an end token or a newline
    that follows some text."""
    import torch

    from kvcodec.integrations.hf import cache_kwarg, continue_from_kv, output_cache

    stops, kw = stop_ids(tokenizer), cache_kwarg(model)
    with torch.inference_mode():
        out = continue_from_kv(model, prefix, kv.to(model.dtype), suffix)
        tokens: list[int] = []
        for _ in range(max_new):
            nxt = int(out.logits[0, -1].argmax())
            if nxt in stops:
                break
            tokens.append(nxt)
            if _ends_answer(tokenizer, tokens):
                break
            out = model(torch.tensor([[nxt]]), use_cache=True, **{kw: output_cache(out)})
    return tuple(tokens)


def generate_like(
    model: Any, tokenizer: Any, prefix: Any, kv: Any, suffix: Any, ref: tuple[int, ...], max_new: int
) -> tuple[int, ...]:
    """generate(), short-cut when the answer is `ref`: one forward over suffix + ref checks that
    greedy decoding would pick every ref token and then stop; otherwise decodes token by token."""
    import torch

    from kvcodec.integrations.hf import continue_from_kv

    if not ref:
        return generate(model, tokenizer, prefix, kv, suffix, max_new)
    with torch.inference_mode():
        out = continue_from_kv(model, prefix, kv.to(model.dtype), torch.cat([suffix, torch.as_tensor(ref)]))
    picks = out.logits[0, suffix.numel() - 1 :].argmax(-1).tolist()  # len(ref) + 1 next-token choices
    stopped_by_token = len(ref) < max_new and not _ends_answer(tokenizer, ref)
    if picks[: len(ref)] == list(ref) and (not stopped_by_token or picks[-1] in stop_ids(tokenizer)):
        return tuple(ref)
    return generate(model, tokenizer, prefix, kv, suffix, max_new)


def _ends_answer(tokenizer: Any, tokens: Sequence[int]) -> bool:
    """generate() stops after these tokens without looking at the next one."""
    text = tokenizer.decode(list(tokens))
    return "\n" in text.strip(" ") and bool(cut_answer(text))


MAX_NEW = {"quoref": 24, "needle": 24}


def score(p: TaskPrompt, answer: str) -> float:
    """F1 against the gold spans (quoref) or 1.0 / 0.0 for a retrieved needle."""
    return best_f1(answer, p.gold) if p.task == "quoref" else float(needle_hit(answer, p.gold[0]))


def evaluate_prompts(
    model: Any, tokenizer: Any, prompts: Sequence[TaskPrompt], runners: dict, log=print, on_row=None
) -> list:
    """Per prompt: the recomputed answer and, per method, the restored one, bytes and values.
    on_row(rows so far) after each prompt (checkpoints)."""
    import torch

    from kvcodec.integrations.hf import cache_to_tensor, forward_ids

    rows = []
    for p in prompts:
        _, cache = forward_ids(model, p.prefix)
        kv_ref = cache_to_tensor(cache).cpu()
        ref_tokens = generate(model, tokenizer, p.prefix, kv_ref, p.suffix, MAX_NEW[p.task])
        ref = cut_answer(tokenizer.decode(ref_tokens, skip_special_tokens=True))
        row = dict(task=p.task, id=p.id, gold=list(p.gold), recomputed=ref, score_recomputed=score(p, ref), **p.meta)
        row["methods"] = {}
        kv16 = kv_ref.to(torch.float16)
        for name, run in runners.items():
            restored, size, _ = run(kv16)
            toks = generate_like(model, tokenizer, p.prefix, restored.float(), p.suffix, ref_tokens, MAX_NEW[p.task])
            got = cut_answer(tokenizer.decode(toks, skip_special_tokens=True))
            row["methods"][name] = dict(
                answer=got, same=same_answer(got, ref), same_tokens=toks == ref_tokens, score=score(p, got), bytes=size
            )
        row["values"] = kv16.numel()
        rows.append(row)
        if on_row is not None:
            on_row(rows)
        same = sum(m["same"] for m in row["methods"].values())
        log(
            f"  {p.id} ({p.prefix.numel()} tok) ref {ref!r} score {row['score_recomputed']:.2f}; same {same}/{len(runners)}"
        )
    return rows


def task_fields(rows: Sequence[dict], method: str) -> dict:
    """Aggregate fields of one method over the task rows (quoref_* and needle_* keys)."""
    out: dict[str, Any] = {}
    for task in ("quoref", "needle"):
        rs = [r for r in rows if r["task"] == task]
        if not rs:
            continue
        ms = [r["methods"][method] for r in rs]
        n = len(rs)
        fields = {
            "n": n,
            "same_answer_rate": sum(m["same"] for m in ms) / n,
            "same_tokens_rate": sum(m["same_tokens"] for m in ms) / n,
            "score_restored": sum(m["score"] for m in ms) / n,
            "score_recomputed": sum(r["score_recomputed"] for r in rs) / n,
        }
        if all(m["bytes"] for m in ms):  # bytes of the zstd path the tasks are coded through
            fields["ratio_vs_fp16_zstd_path"] = 2 * sum(r["values"] for r in rs) / sum(m["bytes"] for m in ms)
        name = {"quoref": "f1", "needle": "retrieval"}[task]
        fields[f"{name}_restored"] = fields.pop("score_restored")
        fields[f"{name}_recomputed"] = fields.pop("score_recomputed")
        out.update({f"{task}_{k}": round(v, 4) if isinstance(v, float) else v for k, v in fields.items()})
    if "quoref_same_answer_rate" in out:
        out["same_answer_rate"] = out["quoref_same_answer_rate"]
        out["f1"] = out["quoref_f1_restored"]
    return out
