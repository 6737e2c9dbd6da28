"""`kvcodec bench accuracy`: does a KV restored from kvcodec answer like the recomputed one?

For each model and quant mode, on real data:

- long-document QA: bigbench minute_mysteries (4-way multiple choice, ~1.5k-token stories). The
  story is prefilled once (the recomputed KV), stored with kvcodec and decoded (the restored KV);
  the question and each option are then scored by log-likelihood on top of either KV.
  accuracy_restored vs accuracy_recomputed, plus how often both pick the same option;
- perplexity of an essay continuation after a restored vs recomputed prefix KV (ppl_delta);
- greedy decoding of N tokens after either KV (token_agreement: fraction of equal positions).

quant "exact" must reproduce the recomputation token for token (same choices, bit-identical
scores, agreement 1.0); the command fails if it does not. With --transform MODEL.kvt, each of
--target-ratios r adds the lossy method kvcodec-transform-<r>: the KV coded by the .kvt's transform
codec at target ratio r vs fp16, chunk by chunk as a store holds it, and decoded. Results:
benchmarks/results/accuracy-*.json and a markdown table.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kvbench.results import RESULTS_DIR, check_tag, command_line, machine, write_result
from kvbench.transform_options import transform_methods, transform_options
from kvcodec.config import QUANT_MODES

# Video-lossless: the restored values depend on the quantizer only, so one (small) resolution
# suffices here and keeps the CPU encode short.
BENCH_RESOLUTION = (256, 256)


@dataclasses.dataclass
class _QuantStats:
    correct: float = 0.0  # multiple choice: right answers; extractive: sum of F1
    exact_match: int = 0  # extractive only
    same_choice: int = 0
    identical_scores: int = 0
    max_score_diff: float = 0.0
    ratio: list = dataclasses.field(default_factory=list)
    ratio_stored: list = dataclasses.field(default_factory=list)
    encode_s: list = dataclasses.field(default_factory=list)
    rel_rms: list = dataclasses.field(default_factory=list)
    ppl_ref: list = dataclasses.field(default_factory=list)
    ppl_got: list = dataclasses.field(default_factory=list)
    agreement: list = dataclasses.field(default_factory=list)
    first_div: list = dataclasses.field(default_factory=list)
    greedy_identical: int = 0
    bit_exact: int = 0  # round trips that returned the stored tensor bit for bit
    round_trips: int = 0


def restore(kv, quant: str, *, identity: bool = False, codec=None):  # noqa: ANN001
    """kvcodec round trip of kv: (restored, stored bytes, encode seconds). `codec`: the chunk codec
    of a kvcodec-transform-<r> method (methods.chunked_transform_codec); None: kvcodec's HEVC codec at `quant`."""
    if identity:  # harness check without the codec
        return kv.clone(), kv.numel() * kv.element_size(), 0.0
    if codec is not None:
        return restore_chunks(kv, codec)
    import kvcodec

    config = kvcodec.CodecConfig(quant=quant, resolutions=(BENCH_RESOLUTION,), search_layout=False)
    t0 = time.perf_counter()
    data = kvcodec.encode(kv, config)
    enc = time.perf_counter() - t0
    return kvcodec.decode(data), len(data), enc


def restore_chunks(kv, codec):  # noqa: ANN001, ANN201
    """Round trip of kv through a chunk codec, chunk by chunk: (restored, bytes of every chunk blob,
    encode seconds)."""
    from kvbench.methods import chunk_bytes, decode_chunks_into, encode_in_chunks

    chunks, enc = encode_in_chunks(codec, kv)
    out = kv.new_empty(kv.shape)
    decode_chunks_into(codec, chunks, out)
    return out, chunk_bytes(chunks), enc


def run_model(
    model_name: str,
    quants: list[str],
    *,
    task: str,
    n_questions: int,
    max_doc_tokens: int,
    ppl_texts: list[str],
    ppl_prefix: int,
    ppl_tokens: int,
    greedy_tokens: int,
    kv_dtype: str,
    identity: bool,
    download: bool,
    log: Callable[[str], None],
    answer_tokens: int = 12,
    transform: Path | None = None,
) -> tuple[list[dict], list[dict]]:
    """(one record per quant, one row per question) of `model_name` on `task` and the perplexity texts.
    quants: quant modes and kvcodec-transform-<r> methods (coded with the .kvt `transform`)."""
    from kvcodec.models.texts import load_qa

    run = ModelRun(model_name, quants, task, kv_dtype, identity, log, answer_tokens, transform)
    questions = load_qa(task, limit=n_questions, download=download)
    t_start = time.perf_counter()
    for qi, q in enumerate(questions):
        row = run.question(q, max_doc_tokens)
        log(
            f"  {model_name} {qi + 1}/{len(questions)} ({row['doc_tokens']} tok) recomputed={row['summary']} "
            + " ".join(
                f"{qq}:{row['choices_restored'][qq]!r}" if run.extractive else f"{qq}:{row['choices_restored'][qq]}"
                for qq in quants
            )
            + f"  [{time.perf_counter() - t_start:.0f} s]"
        )
        del row["summary"]
    for text_name in ppl_texts:
        run.perplexity(text_name, ppl_prefix, ppl_tokens, greedy_tokens)
    settings = {
        "ppl_texts": ppl_texts,
        "ppl_prefix_tokens": ppl_prefix,
        "ppl_scored_tokens": ppl_tokens - 1,
        "greedy_tokens": greedy_tokens,
    }
    return [run.record(quant, len(questions), settings) for quant in quants], run.per_question


class ModelRun:
    """One model's accuracy run: every question answered from recomputed KV and from each quant's
    restored KV, perplexity and greedy agreement on texts, statistics per quant (a quant here is a
    quant mode or a kvcodec-transform-<r> method, coded with the .kvt `transform`)."""

    def __init__(
        self,
        model_name: str,
        quants: list[str],
        task: str,
        kv_dtype: str,
        identity: bool,
        log: Callable[[str], None],
        answer_tokens: int,
        transform: Path | None = None,
    ) -> None:
        import torch

        from kvbench.methods import chunked_transform_codec, transform_ratio
        from kvcodec.models import load_model, model_id

        self.model_name, self.quants, self.task, self.kv_dtype = model_name, quants, task, kv_dtype
        self.identity, self.log, self.answer_tokens = identity, log, answer_tokens
        self.store_dtype = getattr(torch, kv_dtype)
        self.model, self.tok = load_model(model_name)
        self.model_id = model_id(self.model)
        self.extractive = task == "quoref"
        self.stats = {q: _QuantStats() for q in quants}
        self.codecs = {q: chunked_transform_codec(q, transform) for q in quants if transform_ratio(q) is not None}
        self.per_question: list[dict] = []
        self.recomputed_correct, self.recomputed_em = 0.0, 0

    def answer(self, doc, kv, q):  # noqa: ANN001, ANN201
        from kvbench import accuracy_metrics as acc

        if self.extractive:
            return acc.answer_extractive(self.model, self.tok, doc, kv, q, max_new_tokens=self.answer_tokens)
        return acc.answer_multiple_choice(self.model, self.tok, doc, kv, q)

    def round_trip(self, kv_store, quant: str, like):  # noqa: ANN001, ANN201
        """(kv_store encoded with `quant` and restored, in like's dtype; stored bytes; encode seconds)."""
        import torch

        restored, nbytes, enc_s = restore(kv_store, quant, identity=self.identity, codec=self.codecs.get(quant))
        s = self.stats[quant]
        s.round_trips += 1
        s.bit_exact += restored.dtype == kv_store.dtype and torch.equal(
            restored.view(torch.uint8), kv_store.view(torch.uint8)
        )
        return restored.to(like.dtype), nbytes, enc_s

    def question(self, q, max_doc_tokens: int) -> dict:  # noqa: ANN001
        from kvbench import accuracy_metrics as acc
        from kvcodec.integrations.hf import cache_to_tensor, forward_ids

        doc = acc.document_ids(self.tok, q, max_tokens=max_doc_tokens)
        _, cache = forward_ids(self.model, doc)  # the exact ids (decoding and re-tokenizing could change them)
        kv_ref = cache_to_tensor(cache).cpu()
        ref = self.answer(doc, kv_ref, q)
        self.recomputed_correct += ref.f1 if self.extractive else ref.correct
        self.recomputed_em += self.extractive and ref.exact_match
        row: dict[str, Any] = {
            "model": self.model_name,
            "question": q.id,
            "doc_tokens": int(doc.numel()),
            "answer": list(q.answers) if self.extractive else q.answer,
            "choice_recomputed": ref.text if self.extractive else ref.choice,
            "choices_restored": {},
            "summary": f"{ref.text!r} (F1 {ref.f1:.2f})" if self.extractive else ("ok" if ref.correct else "--"),
        }
        kv_store = kv_ref.to(self.store_dtype)
        for quant in self.quants:
            restored, nbytes, enc_s = self.round_trip(kv_store, quant, kv_ref)
            got = self.answer(doc, restored, q)
            self.score(self.stats[quant], got, ref)
            s = self.stats[quant]
            s.ratio.append(kv_store.numel() * 2 / nbytes)  # vs fp16
            s.ratio_stored.append(kv_store.numel() * kv_store.element_size() / nbytes)
            s.encode_s.append(enc_s)
            s.rel_rms.append(acc.kv_error(restored, kv_ref)["rel_rms"])
            row["choices_restored"][quant] = got.text if self.extractive else got.choice
        self.per_question.append(row)
        return row

    def score(self, s: _QuantStats, got, ref) -> None:  # noqa: ANN001
        if self.extractive:
            s.correct += got.f1
            s.exact_match += got.exact_match
            s.same_choice += got.text == ref.text
            s.identical_scores += got.tokens == ref.tokens
            s.max_score_diff = max(s.max_score_diff, abs(got.f1 - ref.f1))
        else:
            s.correct += got.correct
            s.same_choice += got.choice == ref.choice
            s.identical_scores += got.scores == ref.scores
            s.max_score_diff = max(s.max_score_diff, max(abs(a - b) for a, b in zip(got.scores, ref.scores)))

    def perplexity(self, text_name: str, ppl_prefix: int, ppl_tokens: int, greedy_tokens: int) -> None:
        import torch

        from kvbench import accuracy_metrics as acc
        from kvcodec.integrations.hf import extract_kv
        from kvcodec.models.texts import load_text

        ids = self.tok(load_text(text_name), return_tensors="pt").input_ids[0]
        if ids.numel() < ppl_prefix + ppl_tokens:
            raise click.ClickException(f"text {text_name} has {ids.numel()} tokens; need {ppl_prefix + ppl_tokens}")
        prefix, cont = ids[:ppl_prefix], ids[ppl_prefix : ppl_prefix + ppl_tokens]
        got_ids, kv_ref = extract_kv(self.model, self.tok, load_text(text_name), max_tokens=ppl_prefix)
        if not torch.equal(got_ids, prefix):
            raise click.ClickException(f"tokenization of {text_name} is not stable")
        kv_store = kv_ref.to(self.store_dtype)
        for quant in self.quants:
            restored = self.round_trip(kv_store, quant, kv_ref)[0]
            p = acc.perplexity_delta(self.model, prefix, restored, kv_ref, cont)
            a = acc.greedy_agreement(self.model, prefix, restored, kv_ref, cont[:1], greedy_tokens)
            s = self.stats[quant]
            s.ppl_ref.append(p.ppl_reference)
            s.ppl_got.append(p.ppl_restored)
            s.agreement.append(a.agreement)
            s.first_div.append(a.first_divergence)
            s.greedy_identical += a.first_divergence is None
            self.log(
                f"  {self.model_name} {text_name} {quant}: ppl {p.ppl_reference:.4f} -> {p.ppl_restored:.4f}, "
                f"agreement {a.agreement:.3f}"
            )

    def record(self, quant: str, n: int, settings: dict) -> dict:
        s = self.stats[quant]

        def mean(xs: list) -> float | None:
            return statistics.fmean(xs) if xs else None

        def per_question(x: float) -> float | None:
            return x / n if n else None

        ppl_ref, ppl_got = mean(s.ppl_ref), mean(s.ppl_got)
        return {
            "model": self.model_name,
            "model_id": self.model_id,
            "quant": quant,
            "kv_dtype": self.kv_dtype,
            "task": self.task,
            "n_questions": n,
            "accuracy_restored": per_question(s.correct),
            "accuracy_recomputed": per_question(self.recomputed_correct),
            "answer_agreement": per_question(s.same_choice),
            **(
                {
                    "exact_match_restored": per_question(s.exact_match),
                    "exact_match_recomputed": per_question(self.recomputed_em),
                    "accuracy_is": "mean token F1 against the accepted spans",
                }
                if self.extractive
                else {}
            ),
            "identical_scores": s.identical_scores,
            "bit_exact_round_trips": s.bit_exact,
            "round_trips": s.round_trips,
            "stored_dtype_is_model_dtype": self.store_dtype == next(self.model.parameters()).dtype,
            "max_abs_score_diff": s.max_score_diff,
            "ppl_texts": settings["ppl_texts"],
            "ppl_prefix_tokens": settings["ppl_prefix_tokens"],
            "ppl_scored_tokens": settings["ppl_scored_tokens"],
            "ppl_recomputed": ppl_ref,
            "ppl_restored": ppl_got,
            "ppl_delta": (ppl_got - ppl_ref) if ppl_ref is not None else None,
            "greedy_tokens": settings["greedy_tokens"],
            "token_agreement": mean(s.agreement),
            "greedy_identical_texts": s.greedy_identical,
            "first_divergence": list(s.first_div),
            "kv_rel_rms_error": mean(s.rel_rms),
            "ratio_vs_fp16": mean(s.ratio),
            "ratio_vs_stored_dtype": mean(s.ratio_stored),
            "encode_s_cpu_mean": mean(s.encode_s),
            **self.codec_fields(quant),
        }

    def codec_fields(self, quant: str) -> dict:
        """What coded `quant`'s round trips: for a transform method its codec id, target ratio and .kvt."""
        codec = self.codecs.get(quant)
        if self.identity or codec is None:
            return {"codec": "identity" if self.identity else f"kvcodec {BENCH_RESOLUTION[0]}x{BENCH_RESOLUTION[1]}"}
        return {
            "codec": codec.id,
            "target_ratio": codec.target_ratio,
            "kvt_sha256": codec.kvt_hash,
            "chunk_tokens": codec.chunk_tokens,
        }


def exact_failures(records: list[dict]) -> list[str]:
    """Why quant=exact did not reproduce the recomputation (empty when it did).

    exact must always return the stored tensor bit for bit; when the KV is stored in the model's
    own dtype it must also give the recomputation's scores, perplexity and tokens exactly.
    """
    bad = []
    for r in records:
        if r["quant"] != "exact":
            continue
        if r.get("bit_exact_round_trips", r.get("round_trips")) != r.get("round_trips"):
            bad.append(
                f"{r['model']}: exact round trips were bit-exact {r['bit_exact_round_trips']}/{r['round_trips']} times"
            )
        if not r.get("stored_dtype_is_model_dtype", True):
            continue  # a cast to a narrower dtype is not the codec's to undo
        if r["identical_scores"] != r["n_questions"] or r["accuracy_restored"] != r["accuracy_recomputed"]:
            bad.append(
                f"{r['model']}: exact gave different QA scores ({r['identical_scores']}/{r['n_questions']} identical)"
            )
        if r["token_agreement"] not in (None, 1.0) or (r["ppl_delta"] not in (None, 0.0)):
            bad.append(f"{r['model']}: exact gave ppl_delta {r['ppl_delta']} / token_agreement {r['token_agreement']}")
    return bad


def table(doc: dict) -> list[str]:
    f = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
    lines = [
        f"# kvcodec bench accuracy ({doc['machine']['device']})",
        "",
        f"`{doc['command']}`",
        "",
        "| model | quant / method | task | n | acc restored | acc recomputed | same answer | ppl recomputed | ppl delta (restored - recomputed) "
        "| token agreement | first divergence | KV rel. RMS err | ratio vs fp16 |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    lines_notes = [
        "",
        f"KV stored as {doc['settings']['kv_dtype']}; 'ratio vs fp16' compares the stored bytes with fp16 of the same KV.",
        "'same answer': fraction of questions where restored and recomputed KV chose the same option "
        "(quoref: gave the same answer text; 'acc' is then the mean token F1 against the accepted spans).",
        f"'token agreement': fraction of equal positions in two {doc['settings']['greedy_tokens']}-token greedy decodes;",
        "'first divergence': per essay, index of the first differing token (none = identical).",
        *transform_notes(doc["settings"]),
    ]
    for r in doc["records"]:
        lines.append(
            f"| {r['model']} | {r['quant']} | {r['task']} | {r['n_questions']} | {f(r['accuracy_restored'], '.3f')} "
            f"| {f(r['accuracy_recomputed'], '.3f')} | {f(r['answer_agreement'], '.3f')} | {f(r['ppl_recomputed'], '.3f')} "
            f"| {f(r['ppl_delta'], '+.4f')} | {f(r['token_agreement'], '.3f')} "
            f"| {', '.join('none' if d is None else str(d) for d in r['first_divergence'])} "
            f"| {f(r['kv_rel_rms_error'], '.2e')} "
            f"| {f(r['ratio_vs_fp16'], '.2f')} |"
        )
    return lines + lines_notes


def transform_notes(settings: dict) -> list[str]:
    if not settings.get("transform"):
        return []
    return [
        f"kvcodec-transform-<r>: the transform codec of {settings['transform']} at target ratio r vs fp16, coded in "
        f"{settings['transform_chunk_tokens']}-token chunks; its 'ratio vs fp16' counts every chunk's bytes "
        "(a short KV carries more side information a token, so it can fall short of r)."
    ]


@click.command("accuracy")
@click.option(
    "--models",
    default="smollm2-135m",
    show_default=True,
    help="Comma-separated registered names, model folders or .gguf files.",
)
@click.option("--quants", default="exact,int8,int6,int4,int3", show_default=True, help="Comma-separated quant modes.")
@click.option(
    "--task",
    default="minute_mysteries",
    show_default=True,
    type=click.Choice(["minute_mysteries", "quoref"]),
    help="minute_mysteries: 4-way multiple choice over ~1.5k-token stories, scored by likelihood; "
    "quoref: extractive QA over passages, greedy answers scored by F1 / exact match.",
)
@click.option("--n-questions", type=click.IntRange(min=1), default=40, show_default=True)
@click.option(
    "--max-doc-tokens",
    type=click.IntRange(min=16),
    default=2048,
    show_default=True,
    help="Keep at most the last N tokens of each story.",
)
@click.option("--ppl-texts", default="pg/addiction,pg/aord", show_default=True, help="Essays for perplexity / greedy.")
@click.option(
    "--ppl-prefix", type=click.IntRange(min=1), default=1024, show_default=True, help="Prefix tokens (the KV)."
)
@click.option("--ppl-tokens", type=click.IntRange(min=2), default=128, show_default=True, help="Continuation tokens.")
@click.option("--greedy-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--kv-dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default="float32",
    show_default=True,
    help="dtype the KV is stored in (float32: exact restores the model's own KV bit for bit).",
)
@click.option(
    "--quick", is_flag=True, help="Small run: 8 questions, quants exact,int8,int4, one essay, 512-token prefix."
)
@transform_options
@click.option("--identity", is_flag=True, help="Skip the codec (identity round trip): checks the harness only.")
@click.option("--download", is_flag=True, help="Let the command pip-download the bigbench sdist if missing.")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=RESULTS_DIR, show_default=True)
@click.option("--tag", default="cpu", show_default=True, callback=check_tag, help="Suffix of the result file names.")
@click.pass_context
def command(ctx, **o) -> None:  # noqa: ANN001, ANN003
    """QA accuracy, perplexity delta and greedy-token agreement: restored KV vs recomputed KV."""
    o = with_quick_defaults(ctx, o)
    model_list, quant_list, text_list = checked_lists(o["models"], o["quants"], o["ppl_texts"])
    quant_list += transform_methods(ctx, o["kvt"], o["target_ratios"], model_list)
    started = _dt.datetime.now(_dt.UTC)
    t0 = time.perf_counter()
    records, questions = [], []
    for m in model_list:
        click.echo(f"{m}: {o['n_questions']} {o['task']} questions, quants {','.join(quant_list)}", err=True)
        r, q = run_model(
            m,
            quant_list,
            task=o["task"],
            n_questions=o["n_questions"],
            max_doc_tokens=o["max_doc_tokens"],
            ppl_texts=text_list,
            ppl_prefix=o["ppl_prefix"],
            ppl_tokens=o["ppl_tokens"],
            greedy_tokens=o["greedy_tokens"],
            kv_dtype=o["kv_dtype"],
            identity=o["identity"],
            download=o["download"],
            log=lambda msg: click.echo(msg, err=True),
            transform=o["kvt"],
        )
        records += r
        questions += q
    failures = exact_failures(records)
    doc = {
        "benchmark": "accuracy",
        "command": command_line("accuracy"),
        "started_utc": started.isoformat(timespec="seconds"),
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "machine": machine() | {"device": "cpu", "note": CPU_NOTE},
        "settings": settings_record(o, text_list),
        "records": records,
        "per_question": questions,
        "exact_reproduces_recomputation": not failures,
    }
    names = "+".join(os.path.basename(os.path.normpath(m)) for m in model_list)  # a model folder by its name
    stem = f"accuracy-{names}-{o['tag']}{'-quick' if o['quick'] else ''}"
    path = write_result(o["out_dir"] / f"{stem}.json", doc, table(doc))
    click.echo(f"wrote {path} and .md")
    click.echo(path.with_suffix(".md").read_text())
    if failures:
        raise click.ClickException("; ".join(failures))


CPU_NOTE = "models run on the CPU in float32 (GGUF weights dequantized); no GPU was used"
QUICK_DEFAULTS = {"n_questions": 8, "quants": "exact,int8,int4", "ppl_texts": "pg/addiction", "ppl_prefix": 512}


def with_quick_defaults(ctx: click.Context, o: dict) -> dict:
    """--quick: smaller defaults for the options not given on the command line."""
    if not o["quick"]:
        return o
    given = {k for k in QUICK_DEFAULTS if ctx.get_parameter_source(k) == click.core.ParameterSource.COMMANDLINE}
    return o | {k: v for k, v in QUICK_DEFAULTS.items() if k not in given}


def checked_lists(models: str, quants: str, ppl_texts: str) -> tuple[list[str], list[str], list[str]]:
    """(models, quants, texts) from their comma lists; unknown models and quants fail here, before any work."""
    from kvcodec.models.check import inspect_model

    model_list = [m.strip() for m in models.split(",") if m.strip()]
    quant_list = [q.strip() for q in quants.split(",") if q.strip()]
    for q in quant_list:
        if q not in QUANT_MODES:
            raise click.BadParameter(f"{q!r} is not one of {', '.join(QUANT_MODES)}", param_hint="--quants")
    for m in model_list:
        inspect_model(m)  # a registered name, a model folder or a .gguf file, from its config in seconds
    return model_list, quant_list, [t.strip() for t in ppl_texts.split(",") if t.strip()]


def settings_record(o: dict, text_list: list[str]) -> dict:
    keys = ("quick", "n_questions", "max_doc_tokens", "ppl_prefix", "ppl_tokens", "greedy_tokens", "kv_dtype")
    scoring = (
        "greedy answer (12 tokens, first line) after 'Question: ...\\nAnswer:', token F1 and exact "
        "match against the accepted spans"
        if o["task"] == "quoref"
        else "sum of option-token log-probabilities after 'Question: ...\\nAnswer:'"
    )
    from kvbench.methods import STATS_CHUNK_TOKENS

    transform = {
        "transform": str(o["kvt"]) if o["kvt"] else None,
        "target_ratios": o["target_ratios"] if o["kvt"] else None,
        "transform_chunk_tokens": STATS_CHUNK_TOKENS if o["kvt"] else None,
    }
    return (
        {k: o[k] for k in keys}
        | {"ppl_texts": text_list, "identity_codec": o["identity"], "scoring": scoring}
        | transform
    )
