#!/usr/bin/env python3
"""Held-out quality of .kvt files on texts of several kinds (issue 23 target 3), the way calibration's
report measures it (kvcodec.models.quality): each text's first --prefix tokens are coded at each
target ratio (transform: simulated, transform.simulate, sizes from the report's coder, HEVC where an
encoder is installed; baselines: real encodes), restored, and the model continues teacher-forced over
the next --cont tokens on the restored and on the original KV: top-1 agreement and perplexity change,
pooled over the texts and per kind (the name's prefix: pg, py, doc, dlg).

    python benchmarks/probes/kinds_eval.py --kvt essays=/tmp/essays.kvt --kvt mix=/tmp/mix.kvt \
        --eval py/json.decoder,py/difflib,doc/json,doc/difflib,dlg/37,dlg/42 --ratios 3,5,8 \
        --out benchmarks/results/rd-smollm2-135m-cpu-kinds
"""

from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvbench, when not installed

from kvbench.results import write_result  # noqa: E402


def _kind(name: str) -> str:
    return name.split("/")[0]


def _points(rows: list[dict], key) -> dict:
    """Pooled top-1 and perplexity change per (label, ratio) over rows grouped by key."""
    groups: dict = {}
    for r in rows:
        g = groups.setdefault(key(r), {"agree": 0, "n": 0, "nll0": 0.0, "nll1": 0.0, "m": 0, "coded": 0, "raw": 0})
        for f in ("agree", "n", "nll0", "nll1", "m", "coded", "raw"):
            g[f] += r[f]
    return {
        k: {
            "ratio": round(g["raw"] / g["coded"], 3),
            "top1": round(g["agree"] / g["n"], 4),
            "ppl_delta_pct": round(100.0 * (math.exp((g["nll1"] - g["nll0"]) / g["m"]) - 1.0), 3),
            "tokens": g["n"],
        }
        for k, g in groups.items()
    }


@click.command()
@click.option("--model", "model_name", default="smollm2-135m", show_default=True)
@click.option("--kvt", "kvts", multiple=True, required=True, help="LABEL=PATH of a .kvt (repeatable).")
@click.option("--eval", "eval_texts", required=True, help="Comma-separated text names (never calibration texts).")
@click.option("--ratios", default="3,5,8", show_default=True)
@click.option(
    "--baselines",
    default="",
    help="Per-channel int-N of the HEVC codec coded for real (its layout search: slow), e.g. int4.",
)
@click.option("--prefix", "prefix_tokens", default=512, show_default=True)
@click.option("--cont", "cont_tokens", default=128, show_default=True)
@click.option("--defaults-tuned-on", default="smollm2-135m", show_default=True)
@click.option("--note", "notes", multiple=True)
@click.option("--out", "out_stem", required=True)
def main(
    model_name, kvts, eval_texts, ratios, baselines, prefix_tokens, cont_tokens, defaults_tuned_on, notes, out_stem
):
    from kvcodec.cli.calibrate import report_coder
    from kvcodec.codecs import make_codec
    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.models import load_model
    from kvcodec.models.check import inspect_model
    from kvcodec.models.extract import kv_of_ids
    from kvcodec.models.quality import _continue, fp16_bytes, roundtrip
    from kvcodec.models.texts import load_text
    from kvcodec.transform import load_kvt

    texts = [t for t in eval_texts.split(",") if t]
    ratio_list = [float(r) for r in ratios.split(",") if r]
    coder = report_coder()
    cals = {}
    for spec in kvts:
        label, _, path = spec.partition("=")
        cal, digest = load_kvt(path)
        overlap = set(texts) & {*(cal.info.get("sources") or []), *(cal.info.get("quality", {}).get("held_out") or [])}
        if overlap:
            raise click.BadParameter(f"{label}: evaluation texts {sorted(overlap)} were its calibration texts")
        cals[label] = (cal, digest)
    layout = inspect_model(model_name)
    model, tok = load_model(model_name)
    rows = []
    for name in texts:
        ids = tok(load_text(name), return_tensors="pt").input_ids[0][: prefix_tokens + cont_tokens]
        if ids.numel() < prefix_tokens + 2:
            raise click.BadParameter(f"{name} has {ids.numel()} tokens; needs more than {prefix_tokens + 1}")
        kv = kv_of_ids(model, layout, ids[:prefix_tokens])
        cont = ids[prefix_tokens:]
        ref = _continue(model, kv, cont)
        runs = [
            (label, r, TransformCodec(cal, kvt_hash=h, target_ratio=r, coder=coder), r)
            for label, (cal, h) in cals.items()
            for r in ratio_list
        ]
        runs += [(b, None, make_codec("hevc", quant=b), None) for b in baselines.split(",") if b]
        for label, r, codec, target in runs:
            restored, nbytes = roundtrip(codec, kv, target)
            got = _continue(model, restored, cont)
            nll = [float(torch.nn.functional.cross_entropy(x[:-1], cont[1:], reduction="sum")) for x in (ref, got)]
            row = dict(
                text=name, kind=_kind(name), method=label, target=r, agree=int((got.argmax(-1) == ref.argmax(-1)).sum())
            )
            row.update(
                n=cont.numel(), nll0=nll[0], nll1=nll[1], m=cont.numel() - 1, coded=int(nbytes), raw=fp16_bytes(kv)
            )
            rows.append(row)
            click.echo(
                f"{name} {label} {r}: {row['raw'] / row['coded']:.2f}x top1 {row['agree'] / row['n']:.3f}", err=True
            )
    pooled = _points(rows, lambda r: (r["method"], r["target"]))
    by_kind = _points(rows, lambda r: (r["method"], r["target"], r["kind"]))
    records = [
        dict(
            model=model_name,
            method=f"transform-{coder}-simulated-{m}-r{t:g}" if t is not None else m,
            target_ratio=t,
            ratio_vs_fp16=p["ratio"],
            top1_agreement=p["top1"],
            ppl_delta_pct=p["ppl_delta_pct"],
            tokens=p["tokens"],
            calibrated_on=list(cals[m][0].info.get("sources") or []) if m in cals else [],
            defaults_tuned_on=[x for x in defaults_tuned_on.split(",") if x],
            per_kind={k: v for (mm, tt, k), v in by_kind.items() if (mm, tt) == (m, t)},
        )
        for (m, t), p in pooled.items()
    ]
    doc = dict(
        command="python " + shlex.join(sys.argv),
        model=model_name,
        eval_texts=texts,
        prefix_tokens=prefix_tokens,
        cont_tokens=cont_tokens,
        coder=coder,
        kvts={
            label: dict(sha256=h, sources=cal.info.get("sources"), held_out=cal.info.get("quality", {}).get("held_out"))
            for label, (cal, h) in cals.items()
        },
        notes=list(notes),
        records=records,
        rows=rows,
    )
    kinds = sorted({_kind(t) for t in texts})
    md = [
        f"# Held-out quality by kind of text: {', '.join(cals)} ({model_name})",
        "",
        f"Command: `{doc['command']}`",
        "",
        f"Evaluated on {', '.join(texts)} ({prefix_tokens}-token prefix coded, {cont_tokens}-token teacher-forced "
        f"continuation; {len(texts) * cont_tokens} scored positions pooled, {cont_tokens} per text). Transform points "
        f"simulated as calibration's report does (sizes from {coder}); baselines coded for real.",
        "",
        *[f"- {n}" for n in notes],
        *[f"- {label}: calibrated on {', '.join(cal.info.get('sources') or [])}" for label, (cal, _) in cals.items()],
        "",
        "| method | target | ratio vs fp16 | top-1 | ppl delta % | "
        + " | ".join(f"{k} top-1 / ppl %" for k in kinds)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(kinds),
    ]
    for rec in records:
        pk = rec["per_kind"]
        cells = [f"{pk[k]['top1']:.3f} / {pk[k]['ppl_delta_pct']:+.2f}" if k in pk else "" for k in kinds]
        md.append(
            f"| {rec['method']} | {rec['target_ratio'] or ''} | {rec['ratio_vs_fp16']:.2f}x | {rec['top1_agreement']:.4f} | "
            f"{rec['ppl_delta_pct']:+.2f} | " + " | ".join(cells) + " |"
        )
    write_result(out_stem + ".json", doc, md)
    click.echo("\n".join(md))


if __name__ == "__main__":
    main()
