#!/usr/bin/env python3
"""Distortion weighting of the transform codec, measured: plain-MSE KLT vs Fisher-weighted KLT
(weights = diagonal Fisher ** alpha) at one target ratio, on held-out essays.

    python benchmarks/probes/rd_weights.py --model smollm2-135m --alphas 0,0.5,1 \
        --out benchmarks/results/rd-smollm2-135m-cpu-weights

Calibration (PCA and Fisher) on --calib texts, evaluation on --eval texts (never the same): the
prefix's KV is recomputed, cast to fp16, encoded, restored; the continuation is teacher-forced on
the restored and on the recomputed KV (top-1 agreement, perplexity change, ratio vs fp16 counting
every byte of every chunk blob). Fisher: kvcodec.transform.sensitivity, 2 draws per text.
"""

from __future__ import annotations

import json
import math
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rd.py and kvbench, when not installed
from rd import chunk_roundtrip  # noqa: E402


def _ids(tok, name, n):
    from kvcodec.models.texts import load_text

    return tok(load_text(name), return_tensors="pt").input_ids[0][:n]


def _scores(model, prefix, kv, cont):
    """(top-1 tokens, per-token NLL of cont, float32 log-probabilities) of the continuation on kv."""
    from kvcodec.integrations.hf import continue_from_kv

    logits = continue_from_kv(model, prefix, kv.to(model.dtype), cont).logits[0, :-1].double()
    logp = torch.log_softmax(logits, -1)
    nll = -logp.gather(1, cont[1:, None]).squeeze(1)
    return logits.argmax(-1), nll, logp.float()


def _evaluate(model, items, codec, label, measure=None):
    """Top-1 agreement, perplexity change and ratio over items; measure(item, restored, logp, chunks)
    may return extra per-text totals (dict of floats), reported summed and divided by the scored tokens."""
    agree = n = size = values = 0
    nll = ref = 0.0
    per_text, extra = [], {}
    for it in items:
        kv16 = it["kv"].to(torch.float16)
        restored, b, chunks = chunk_roundtrip(codec, kv16)
        top, lo, logp = _scores(model, it["prefix"], restored.float(), it["cont"])
        a = int((top == it["top"]).sum())
        agree, n, size, values = agree + a, n + top.numel(), size + b, values + kv16.numel()
        nll, ref = nll + float(lo.sum()), ref + float(it["nll"].sum())
        per_text.append(a)
        for k, v in (measure(it, restored.float(), logp, chunks) if measure else {}).items():
            extra[k] = extra.get(k, 0.0) + v
    rec = dict(
        method=label,
        ratio_vs_fp16=round(2 * values / size, 3),
        bits_per_value=round(8 * size / values, 4),
        top1_agreement=round(agree / n, 4),
        agree=agree,
        tokens_scored=n,
        ppl_delta_pct=round(100 * (math.exp((nll - ref) / n) - 1), 3),
        agree_per_text=per_text,
        **{k: v / n for k, v in extra.items()},
    )
    click.echo(json.dumps(rec), err=True)
    return rec


def _eval_items(model, tok, evals, prefix_tokens, cont_tokens):
    """Per held-out text: prefix and continuation ids, the recomputed prefix KV (fp32) and the
    reference top-1 / NLL / log-probabilities of the continuation on it."""
    from kvcodec.integrations.hf import cache_to_tensor, forward_ids

    items = []
    for name in evals:
        ids = _ids(tok, name, prefix_tokens + cont_tokens)
        prefix, cont = ids[:prefix_tokens], ids[prefix_tokens:]
        kv = cache_to_tensor(forward_ids(model, prefix)[1]).cpu()
        top, nll, logp = _scores(model, prefix, kv, cont)
        items.append(dict(name=name, prefix=prefix, cont=cont, kv=kv, top=top, nll=nll, logp=logp))
    return items


def _commit():
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


@click.command()
@click.option("--model", "model_name", default="smollm2-135m", show_default=True)
@click.option("--calib", default="pg/addiction,pg/aord,pg/apple,pg/avg", show_default=True)
@click.option("--calib-tokens", default=1024, show_default=True)
@click.option(
    "--eval", "eval_texts", default="pg/web20,pg/gap,pg/love,pg/popular,pg/want,pg/wisdom,pg/worked,pg/useful"
)
@click.option("--prefix", "prefix_tokens", default=512, show_default=True)
@click.option("--cont", "cont_tokens", default=128, show_default=True)
@click.option("--ratio", default=5.0, show_default=True)
@click.option("--alphas", default="0,0.5,1", show_default=True, help="0 = plain MSE.")
@click.option("--out", "out_stem", required=True)
def main(model_name, calib, calib_tokens, eval_texts, prefix_tokens, cont_tokens, ratio, alphas, out_stem):
    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.integrations.hf import extract_kv
    from kvcodec.integrations.hf_fisher import fisher_diagonal
    from kvcodec.models import load_model
    from kvcodec.models.texts import load_text
    from kvcodec.transform import RopeSpec, calibrate
    from kvcodec.transform.weights import channel_weights

    calib_list, evals = calib.split(","), eval_texts.split(",")
    if set(calib_list) & set(evals):
        raise click.BadParameter("evaluation texts must not be calibration texts")
    model, tok = load_model(model_name)
    rope = RopeSpec.from_hf_config(model.config)
    t0 = time.perf_counter()
    kvs, seqs = [], []
    for name in calib_list:
        ids, kv = extract_kv(model, tok, load_text(name), calib_tokens)
        kvs.append(kv)
        seqs.append(ids[: prefix_tokens + cont_tokens])
    fisher = fisher_diagonal(model, seqs, prefix_tokens)
    calib_s = time.perf_counter() - t0
    items = _eval_items(model, tok, evals, prefix_tokens, cont_tokens)
    records = []
    for a in (float(x) for x in alphas.split(",")):
        w = channel_weights(fisher, rope_style=rope.style, rotary_dim=rope.rotary_dim, alpha=a) if a > 0 else None
        cal = calibrate(kvs, rope, weights=w)
        codec = TransformCodec(cal, kvt_hash="0" * 64, target_ratio=ratio)
        label = f"transform-hevc-r{ratio:g}-" + (f"fisher{a:g}" if a > 0 else "mse")
        records.append(dict(model=model_name, alpha=a, **_evaluate(model, items, codec, label)))
    commit = _commit()
    doc = dict(
        command="python " + shlex.join(sys.argv),
        machine=f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        commit=commit,
        model=model_name,
        calibration=dict(sources=calib_list, seconds_incl_fisher=round(calib_s, 1)),
        eval_texts=evals,
        prefix_tokens=prefix_tokens,
        cont_tokens=cont_tokens,
        records=records,
    )
    Path(out_stem + ".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        f"# Transform codec: plain-MSE vs Fisher-weighted KLT ({doc['machine']})",
        "",
        f"Command: `{doc['command']}`",
        "",
        f"Model {model_name}; calibrated (PCA + Fisher) on {', '.join(calib_list)}; evaluated on {', '.join(evals)} "
        f"({prefix_tokens}-token prefix, {cont_tokens}-token teacher-forced continuation).",
        "",
        "| method | ratio vs fp16 | top-1 agreement | agreeing / scored | ppl delta % |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['method']} | {r['ratio_vs_fp16']:.2f}x | {r['top1_agreement']:.4f} | {r['agree']} / {r['tokens_scored']} "
            f"| {r['ppl_delta_pct']:+.2f} |"
        )
    Path(out_stem + ".md").write_text("\n".join(lines) + "\n")
    click.echo("\n".join(lines))


if __name__ == "__main__":
    main()
