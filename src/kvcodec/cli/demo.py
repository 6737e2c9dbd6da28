"""`kvcodec demo`: one long document, asked twice; the second time its KV comes over a slow link.

Runs on a CPU in about 80 s (after the model's first download/conversion): no server, an
embedded `file://` store in a temp dir, a real model (default smollm2-135m) and a real essay.

0. a quick transform calibration (.kvt) on the KV of other essays than the document (demo_transform);
1. request 1 (question 1): full prefill; the document's KV is encoded with kvcodec (int8) and stored;
2. request 2 (question 2), full prefill, for reference (its fp16 KV is stored raw, for step 3);
   that fp16 KV is also coded with the transform codec into a store of its own;
3. request 2 again, restoring the document's raw fp16 KV over the emulated link;
4. request 2 again, restoring the document's kvcodec (int8) KV over the same link;
5. request 2 again, restoring the document's transform-coded KV over the same link.
It prints TTFT for 2-5, the bytes each fetch moved (the compression ratio), whether the greedy
answers are identical, and where kvcodec wins and loses in the run.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from kvcodec.cli.options import FiniteRange, check_report_path, device_option
from kvcodec.config import QUANT_MODES

QUESTIONS = (
    "What is this text about? Answer in one sentence.",
    "What did the author do first, according to the text? Answer briefly.",
)
CALIB_TOKENS = 384  # per essay: 2 x 384 fitted takes seconds on a CPU (the fewest SmolLM2's fit accepts)
STEPS = 8


def _say(msg: str) -> None:
    click.echo(msg, err=True)


@click.command("demo")
@click.option("--model", "model_name", default="smollm2-135m", show_default=True, help="Model (kvcodec.models).")
@click.option("--text", "text_name", default="pg/worked", show_default=True, help="Document (kvcodec.models.texts).")
@click.option(
    "--doc-tokens", default=2048, show_default=True, type=click.IntRange(min=1), help="Tokens of the document to use."
)
@click.option(
    "--gbit",
    default=1.0,
    show_default=True,
    type=FiniteRange(min=0, min_open=True),
    help="Emulated link bandwidth (Gbit/s, token bucket).",
)
@click.option(
    "--quant", type=click.Choice(QUANT_MODES), default="int8", show_default=True, help="kvcodec quantization."
)
@click.option(
    "--transform-ratio",
    default=None,
    type=FiniteRange(min=1, min_open=True),
    help="Transform codec: stored size = fp16 size / this (default: its 'accurate' preset).",
)
@click.option(
    "--calib-tokens",
    default=CALIB_TOKENS,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens of each calibration essay (the transform's quick calibration).",
)
@click.option("--chunk-tokens", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--max-new-tokens", default=24, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--store",
    "store_dir",
    default=None,
    type=click.Path(file_okay=False, writable=True),
    help="Directory for the file:// store (default: a temp dir).",
)
@device_option(default=None, help="cpu or cuda (default: cuda if available).")
@click.option(
    "--threads", default=None, type=click.IntRange(min=1), help="torch CPU threads (default: torch's choice)."
)
@click.option(
    "--json-out",
    default=None,
    type=click.Path(dir_okay=False, path_type=Path),
    callback=check_report_path,
    help="Also write the numbers as JSON.",
)
def command(
    model_name: str,
    text_name: str,
    doc_tokens: int,
    gbit: float,
    quant: str,
    transform_ratio: float,
    calib_tokens: int,
    chunk_tokens: int,
    max_new_tokens: int,
    store_dir: str | None,
    device: str | None,
    json_out: Path | None,
    threads: int | None,
) -> None:
    """Store a document's KV, then reuse it over an emulated link: TTFT and identical answers."""
    import tempfile

    from kvcodec.cli.serve import check_model
    from kvcodec.models.texts import load_text

    if doc_tokens < chunk_tokens:  # the store holds whole chunks: a shorter document leaves nothing to reuse
        raise click.BadParameter(f"{doc_tokens} is fewer than --chunk-tokens {chunk_tokens}", param_hint="--doc-tokens")
    check_model(model_name)  # before the model loads: a model kvcodec cannot code, from its config
    load_text(text_name)  # an unknown text, likewise
    t_start = time.perf_counter()
    if threads:
        import torch

        torch.set_num_threads(threads)
    _say(f"[1/{STEPS}] loading {model_name} (the first run converts the weights, ~30 s) ...")
    from kvcodec.models import load_model

    model, tok = load_model(model_name)
    tmp = None
    if store_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvcodec-demo-")
        store_dir = tmp.name
    os.makedirs(store_dir, exist_ok=True)
    qc = _calibrate(model, tok, model_name, text_name, calib_tokens, store_dir)
    doc_ids = tok(load_text(text_name), add_special_tokens=False)["input_ids"][:doc_tokens]
    p1, p2 = _prompts(tok, tok.decode(doc_ids))
    shared = next((i for i, (a, b) in enumerate(zip(p1, p2)) if a != b), min(len(p1), len(p2)))
    codecs = _codecs(qc, transform_ratio, chunk_tokens)
    engines = _engines(model, tok, store_dir, gbit, quant, chunk_tokens, shared, device, codecs)
    engines[0].generate([1, 2, 3, 4], max_new_tokens=2, reuse=False, store=False)  # warm-up
    _say(
        f"      document: {text_name}, {len(doc_ids)} tokens; prompts {len(p1)} / {len(p2)} tokens; "
        f"link {gbit:g} Gbit/s (token bucket)"
    )
    runs = _story(engines, p1, p2, gbit, max_new_tokens)
    rec = _report(model_name, str(engines[0].device), len(doc_ids), gbit, quant, runs, codecs[2])
    rec["verdict"] = _verdict(runs, gbit, qc)
    if qc is not None:
        rec["transform"].update(
            calibration_s=qc.seconds,
            calibration_prefill_s=qc.prefill_s,
            calibration_texts=list(qc.fitted),
            held_out=qc.held_out,
        )
        rec["transform"].update(tokens_per_text=qc.tokens_per_text, store_s=runs.tr_store_s)
    click.echo(f"total demo time {time.perf_counter() - t_start:.0f} s")
    if json_out:
        import json

        with open(json_out, "w") as f:
            json.dump(rec, f, indent=2)
    for e in engines:
        if e is not None:
            e.close()
    if tmp is not None:
        tmp.cleanup()
    if unused := runs.not_reused():
        raise click.ClickException(
            "nothing was restored for "
            + "; ".join(f"{k} ({why})" for k, why in unused.items())
            + ": those rows measured recomputation, not reuse"
        )


@dataclass(frozen=True)
class Runs:
    """Request 2's results: full prefill (ref), raw fp16 reuse, kvcodec reuse, transform reuse (None:
    not shown), and the seconds each coded store took."""

    ref: Any
    raw: Any
    kvc: Any
    tr: Any
    kvc_store_s: float
    tr_store_s: float | None

    def not_reused(self) -> dict[str, str]:
        """The reuse runs that restored no token, with their fetch error."""
        runs = {"raw fp16 reuse": self.raw, "kvcodec reuse": self.kvc, "transform reuse": self.tr}
        return {k: r.fetch_error or "no error" for k, r in runs.items() if r is not None and not r.restored_tokens}


def _calibrate(model, tok, model_name: str, text_name: str, tokens: int, out_dir: str):  # noqa: ANN001, ANN202
    """Step 2: the transform's quick calibration (demo_transform), or None for a grouped cache."""
    from kvcodec.cli.demo_transform import calibration_texts, quick_calibration

    texts = calibration_texts(text_name)
    _say(
        f"[2/{STEPS}] transform codec: calibrating on the KV of {', '.join(texts[:-1])} (held out: {texts[-1]}), "
        "not the document ..."  # the tokens per text follow: at least what the fit needs, which may exceed `tokens`
    )
    qc = quick_calibration(model, tok, model_name, text_name, tokens, out_dir)
    if qc is None:
        _say("      not shown for this model: its cache has several layer groups")
    else:
        _say(
            f"      {os.path.basename(qc.path)} in {qc.seconds:.1f} s: prefills {qc.prefill_s:.1f} s, fit + save "
            f"{qc.seconds - qc.prefill_s:.1f} s ({qc.tokens_per_text} tokens per text)"
        )
    return qc


def _codecs(qc, ratio: float | None, chunk_tokens: int) -> tuple:  # noqa: ANN001
    """(kvcodec, raw, transform) codec objects: None for the int8 one (the engine's own, from its
    CodecConfig); the transform's None when there is no calibration."""
    from kvcodec.codecs.transform.codec import PRESETS, make_transform_codec
    from kvcodec.fetcher.rawcodec import RawCodec

    tr = None
    if qc is not None:
        tr = make_transform_codec(qc.path, target_ratio=ratio or PRESETS["accurate"], chunk_tokens=chunk_tokens)
    return None, RawCodec(), tr


def _prompts(tok, doc: str) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """The two questions' prompts: the shared prefix is the system prompt + document; only that
    prefix is stored (so both methods restore the same tokens)."""

    def prompt(q: str) -> list[int]:
        msgs = [{"role": "user", "content": f"{doc}\n\n{q}"}]
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        else:
            text = f"{doc}\n\nQuestion: {q}\nAnswer:"
        return tok(text, add_special_tokens=False)["input_ids"]

    return prompt(QUESTIONS[0]), prompt(QUESTIONS[1])


def _engines(
    model,
    tok,
    store_dir: str,
    gbit: float,
    quant: str,
    chunk_tokens: int,
    shared: int,  # noqa: ANN001
    device: str | None,
    codecs: tuple,
) -> tuple:
    """(kvcodec, raw fp16, transform or None) engines, each storing into its own file:// store behind the link."""
    import urllib.parse

    from kvcodec.config import CodecConfig
    from kvcodec.engine import Engine, StorePolicy

    cfg = CodecConfig(quant=quant, chunk_tokens=chunk_tokens, resolutions=((512, 512),))
    policy = StorePolicy(max_tokens=shared, dtype="float16")

    def engine(sub: str, codec=None) -> Engine:  # noqa: ANN001
        inner = "file://" + os.path.join(store_dir, sub)
        url = f"throttle://{gbit}?inner={urllib.parse.quote(inner, safe='')}"
        # no fetch deadline: the demo measures each method's fetch, even one slower than a prefill
        return Engine(
            model,
            tokenizer=tok,
            store_url=url,
            codec_config=None if sub == "transform" else cfg,  # the transform codec is configured itself
            codec=codec,
            store_policy=policy,
            max_batch=1,
            device=device,
            resolution_policy="fixed:0",
            store_partial=False,
            fetch_deadline_s=None,
        )

    kvc_codec, raw_codec, tr_codec = codecs
    tr = engine("transform", tr_codec) if tr_codec is not None else None
    return engine("kvcodec", kvc_codec), engine("raw", raw_codec), tr


def _story(engines: tuple, p1: list[int], p2: list[int], gbit: float, max_new_tokens: int) -> Runs:
    """Steps 3-8: store, reference prefill, transform store, raw, kvcodec and transform reuse."""
    kvc, raw, tre = engines

    def run(eng, ids: list[int], reuse: bool, store: bool):  # noqa: ANN001, ANN202
        out = eng.generate([ids], max_new_tokens=max_new_tokens, reuse=reuse, store=store)[0]
        t0 = time.perf_counter()
        eng.storer.flush()
        return out, time.perf_counter() - t0

    def reuse(step: int, name: str, eng):  # noqa: ANN001, ANN202
        _say(f"[{step}/{STEPS}] request 2: {name} KV reuse over the {gbit:g} Gbit/s link ...")
        r, _ = run(eng, p2, reuse=True, store=False)
        _say(f"      TTFT {r.ttft_s:.2f} s ({r.restored_tokens} tokens restored, {r.bytes_fetched / 1e6:.1f} MB)")
        return r

    _say(f"[3/{STEPS}] request 1: full prefill, then encode + store the document's KV with kvcodec ...")
    r1, enc1 = run(kvc, p1, reuse=False, store=True)
    _say(f"      TTFT {r1.ttft_s:.2f} s; kvcodec encode+store finished {enc1:.1f} s after the answer")
    _say(f"[4/{STEPS}] request 2: full prefill (reference); its fp16 KV is stored raw for steps 5 and 6 ...")
    ref, _ = run(raw, p2, reuse=False, store=True)
    _say(f"      TTFT {ref.ttft_s:.2f} s")
    tr_store = None
    if tre is not None:
        from kvcodec.cli.demo_transform import transcode

        _say(f"[5/{STEPS}] the stored fp16 KV, coded with the transform codec into its own store ...")
        n, tr_store = transcode(raw.prefix_cache, tre.prefix_cache, p2)
        _say(f"      {n} tokens encoded + stored in {tr_store:.1f} s")
    rr = reuse(6, "raw fp16", raw)
    kr = reuse(7, "kvcodec", kvc)
    tr = reuse(8, "transform-coded", tre) if tre is not None else None
    return Runs(ref, rr, kr, tr, enc1, tr_store)


def _wins(a: float, b: float) -> str:
    return "wins" if a < b else "loses"


def _verdict(runs: Runs, gbit: float, qc) -> list[str]:  # noqa: ANN001
    """Where kvcodec wins and where it loses in this run, in words (printed and returned)."""
    ref, rr, kr, tr = runs.ref, runs.raw, runs.kvc, runs.tr
    shown = [("kvcodec", kr)] + ([("transform", tr)] if tr is not None else [])
    lines = [
        "vs recomputing: "
        + "; ".join(
            f"{n} reuse {_wins(r.ttft_s, ref.ttft_s)} ({r.ttft_s:.2f} vs {ref.ttft_s:.2f} s)" for n, r in shown
        ),
        f"vs raw fp16 reuse over {gbit:g} Gbit/s ({rr.ttft_s:.2f} s): "
        + "; ".join(
            f"{n} {_wins(r.ttft_s, rr.ttft_s)} ({r.ttft_s:.2f} s, {_ratio(rr, r):.1f}x fewer bytes)" for n, r in shown
        )
        + ", paid for by decoding on the CPU: the slower the link, the larger the win",
        f"storing: the kvcodec encode finished {runs.kvc_store_s:.1f} s after the first answer"
        + (f"; the transform encode + store took {runs.tr_store_s:.1f} s" if tr is not None else "")
        + " (off the request's path; kvcodec bench encode measures encode speed)",
    ]
    lines.append(
        "break-even, estimated from this run (TTFT less bytes / link rate, the rest held fixed; fetches overlap "
        "decoding, so roughly): " + "; ".join(_break_even(rr, r, n, gbit) for n, r in shown)
    )
    if qc is not None:
        same = "identical to" if tr.token_ids == ref.token_ids else "NOT identical to"
        lines.append(
            f"transform quality: its answer is {same} full prefill's, with a .kvt calibrated in {qc.seconds:.1f} s on "
            f"{len(qc.fitted)} x {qc.tokens_per_text} tokens of other essays (kvcodec calibrate --model fits "
            "16 texts and reports held-out quality per ratio: docs/TRANSFORM.md)"
        )
    click.echo("where kvcodec wins and loses in this run:")
    for line in lines:
        click.echo(f"  - {line}")
    return lines


def _break_even(raw, r, name: str, gbit: float) -> str:  # noqa: ANN001
    """In words: below which link rate `r` (fewer bytes, more decode) would beat raw fp16 reuse."""
    bits = 8 / (gbit * 1e9)  # seconds per byte on the link
    rest_raw, rest = raw.ttft_s - raw.bytes_fetched * bits, r.ttft_s - r.bytes_fetched * bits
    saved = (raw.bytes_fetched - r.bytes_fetched) * 8 / 1e9  # Gbit fewer on the link
    if saved <= 0:
        return f"{name} moves no fewer bytes than raw fp16"
    if rest <= rest_raw:
        return f"{name} beats raw fp16 reuse at any link rate"
    return f"{name} beats raw fp16 reuse below ~{saved / (rest - rest_raw):.2g} Gbit/s"


def _ratio(raw, r) -> float:  # noqa: ANN001
    """Bytes raw fp16 reuse fetched over the bytes `r` fetched (nan when `r` fetched none)."""
    return raw.bytes_fetched / r.bytes_fetched if r.bytes_fetched else float("nan")


def _report(model_name: str, dev: str, doc_tokens: int, gbit: float, quant: str, runs: Runs, tr_codec) -> dict:  # noqa: ANN001
    """Print the comparison table and the answers; return them as a JSON record."""
    import sys

    ref, rr, kr, tr = runs.ref, runs.raw, runs.kvc, runs.tr
    video = "NVDEC" if dev.startswith("cuda") else "FFmpeg on the CPU"
    decoder = f"zstd'd samples on the host's threads, video on {video}"  # each chunk says which it holds
    shown = {"raw": rr, "kvcodec": kr, **({"transform": tr} if tr is not None else {})}
    same = {k: r.token_ids == ref.token_ids for k, r in shown.items()}
    rows = [("full prefill", ref), ("raw fp16 KV reuse", rr), (f"kvcodec ({quant}) reuse", kr)]
    if tr is not None:
        rows.append((f"transform ({tr_codec.target_ratio:g}x) reuse", tr))
    click.echo("")
    click.echo(f"model {model_name} on {dev}; document {doc_tokens} tokens; link {gbit:g} Gbit/s; decoder {decoder}")
    click.echo(f"{'method':<24}{'TTFT (s)':>10}{'vs prefill':>12}{'prefilled':>11}{'fetched MB':>12}{'vs fp16':>9}")
    for name, r in rows:
        vs = f"{_ratio(rr, r):>8.2f}x" if r is not ref else f"{'':>9}"
        b = r.bytes_fetched if r is not ref else 0
        click.echo(
            f"{name:<24}{r.ttft_s:>10.3f}{ref.ttft_s / r.ttft_s:>11.2f}x{r.prefilled_tokens:>11}{b / 1e6:>12.2f}{vs}"
        )
    click.echo(
        f"compression vs raw fp16 KV: kvcodec {_ratio(rr, kr):.2f}x"
        + (f", transform {_ratio(rr, tr):.2f}x" if tr else "")
    )
    click.echo(f"answer (full prefill):     {ref.text.strip()!r}")
    click.echo(f"answer (kvcodec reuse):    {kr.text.strip()!r}")
    if tr is not None:
        click.echo(f"answer (transform reuse):  {tr.text.strip()!r}")
    yes = {k: "yes" if v else "NO" for k, v in same.items()}
    click.echo(
        f"greedy answers identical: raw reuse {yes['raw']}, kvcodec {yes['kvcodec']}"
        + (f", transform {yes['transform']}" if tr is not None else "")
    )
    errors = {k: r.fetch_error for k, r in shown.items() if r.fetch_error}
    if errors:
        click.echo(f"fetch errors (recomputed): {errors}")
    return {
        "command": " ".join(["kvcodec"] + sys.argv[1:]),
        "model": model_name,
        "device": dev,
        "doc_tokens": doc_tokens,
        "link_gbit": gbit,
        "quant": quant,
        "ttft_s": {"prefill": ref.ttft_s, **{k: r.ttft_s for k, r in shown.items()}},
        "bytes_fetched": {k: r.bytes_fetched for k, r in shown.items()},
        "restored_tokens": {k: r.restored_tokens for k, r in shown.items()},
        "compression_vs_fp16": _ratio(rr, kr),
        "identical": same,
        "answers": {"prefill": ref.text, **{k: r.text for k, r in shown.items()}},
        "transform": {"target_ratio": tr_codec.target_ratio, "compression_vs_fp16": _ratio(rr, tr)} if tr else None,
    }
