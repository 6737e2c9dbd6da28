#!/usr/bin/env python3
"""Precision where the model looks, measured at one file size: a finer step for the prefix's last
tokens, the number of fp16 sink tokens, and the reconstruction point of each quantizer bin.

    python benchmarks/probes/rd_precision.py --model smollm2-135m --kvt smollm2-135m.kvt \
        --configs 'base=recon=centre;tail32x1=fine_tokens=32,fine_bits=1' \
        --out benchmarks/results/rd-precision-cpu

Every configuration is a TransformCodec at the same --ratio (the size search counts what it adds:
finer tail tokens, fp16 sink tokens). Evaluation as benchmarks/probes/rd_weights.py (its helpers):
held-out essays, the prefix's KV recomputed, cast to fp16, encoded, restored; the continuation is
teacher-forced on the restored and on the recomputed KV. `--mse` also reports the Fisher-weighted
squared error of each reconstruction rule on the same integers (no model run), per essay.
The .kvt must be calibrated on other texts (`kvcodec calibrate --model M --texts ...`).
"""

from __future__ import annotations

import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rd_weights import _eval_items, _evaluate  # noqa: E402

EVAL = "pg/web20,pg/gap,pg/love,pg/popular,pg/want,pg/wisdom,pg/worked,pg/useful"


def _options(text: str) -> dict:
    """'fine_tokens=32,fine_bits=1,recon=laplace' -> codec keyword options (ints where they parse)."""
    out = {}
    for part in filter(None, text.split(",")):
        k, v = part.split("=", 1)
        out[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
    return out


def _configs(text: str) -> list[tuple[str, dict]]:
    """'name=opts;name=opts' (opts as in _options; a name alone: the codec's defaults)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, opts = part.partition("=")
        out.append((name, _options(opts)))
    return out


def _items(model, tok, evals, prefix_tokens, cont_tokens, cache: Path | None, model_name: str) -> list[dict]:
    """rd_weights' evaluation items (recomputed KV and its scores per essay), cached on disk if asked."""
    path = cache / f"items-{model_name}-{prefix_tokens}-{cont_tokens}-logp.pt" if cache else None
    if path is not None and path.exists():
        items = torch.load(path)
        if [it["name"] for it in items] == evals:
            return items
    items = _eval_items(model, tok, evals, prefix_tokens, cont_tokens)  # "logp": the reference distribution
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(items, path)
    return items


def kl_measure(item, restored, logp, chunks) -> dict:
    """Summed KL(reference || restored) of the continuation's next-token distributions (nats),
    and the same over the first 8 continuation tokens (where the prefix's last tokens matter most)."""
    ref = item["logp"].float()
    kl = (ref.exp() * (ref - logp)).sum(-1)
    return {"kl_nats": float(kl.sum()), "kl_first8_nats": float(kl[:8].sum()) * len(kl) / 8}


def weighted_mse(codec, kv16: torch.Tensor, recons) -> dict:
    """Per reconstruction rule: squared error of the coded coefficients (the Fisher-weighted KV
    error, since the KLT of the weighted channels is orthonormal) per value, on the very integers
    the codec codes for kv16 at its target size; sink tokens left out (they are fp16)."""
    from kvcodec.transform import quantize

    first = 0
    y = codec.coefficients(kv16, first)
    theta = codec._level(y, kv16, first)
    plan = codec.plan(theta)
    coded = y.index_select(1, codec._columns(plan))[codec.sink_tokens :].double()
    q = quantize.quantize(coded, plan.steps)
    out = {}
    for rule in recons:
        rec = quantize.dequantize(q, plan.steps, torch.float64, sigmas=plan.sigmas, recon=rule)
        out[rule] = float((rec - coded).pow(2).sum() / kv16[:, :, codec.sink_tokens :].numel())
    return out


def _merged(docs: list[dict]) -> dict:
    """One result from several runs (one per model, say): their records, commands and commits."""
    out = dict(docs[0], records=[], mse=[], partial=any(d.get("partial") for d in docs))
    out["command"] = " ; ".join(d["command"] for d in docs)
    out["commit"] = ",".join(sorted({d["commit"] for d in docs}))
    for d in docs:
        out["records"] += d["records"]
        out["mse"] += d.get("mse", [])
    return out


def _write(doc: dict, out_stem: str) -> None:
    Path(out_stem + ".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [f"# Transform codec: precision where the model looks ({doc['machine']})", ""]
    lines += [f"Command: `{doc['command']}`", "", doc["setup"], ""]
    if doc.get("partial"):
        lines += ["**Partial run**: stopped before every configuration was measured.", ""]
    lines += [line for note in doc.get("notes", []) for line in (note, "")]
    lines += [
        "KL: mean KL(recomputed || restored) of the next-token distribution per scored token (milli-nats); "
        "first 8: over the first 8 continuation tokens only.",
        "",
        "| model | config | codec id (sink, chunk, finer tail, reconstruction) | ratio vs fp16 | top-1 agreement | agreeing / scored | ppl delta % | KL mnats "
        "| KL first 8 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["records"]:
        lines.append(
            f"| {r['model']} | {r['config']} | `{r['codec_id'].rsplit('-kw', 1)[-1].split('-', 1)[-1]}` | {r['ratio_vs_fp16']:.3f}x | {r['top1_agreement']:.4f} "
            f"| {r['agree']} / {r['tokens_scored']} | {r['ppl_delta_pct']:+.3f} | {1000 * r['kl_nats']:.3f} "
            f"| {1000 * r['kl_first8_nats']:.3f} |"
        )
    if doc.get("mse"):
        lines += ["", "Fisher-weighted squared error per value of the coded coefficients, same integers:", ""]
        rules = list(doc["mse"][0]["by_rule"])
        lines += ["| model | text | " + " | ".join(rules) + " |", "|---|---|" + "---|" * len(rules)]
        for m in doc["mse"]:
            base = m["by_rule"][rules[0]]
            cells = [f"{v:.4g} ({v / base:.4f})" for v in m["by_rule"].values()]
            lines.append(f"| {m['model']} | {m['text']} | " + " | ".join(cells) + " |")
    Path(out_stem + ".md").write_text("\n".join(lines) + "\n")


@click.command()
@click.option("--model", "model_name", default="smollm2-135m", show_default=True)
@click.option("--kvt", help="calibration (.kvt) made from other texts than --eval")
@click.option("--eval", "eval_texts", default=EVAL, show_default=True)
@click.option("--prefix", "prefix_tokens", default=512, show_default=True)
@click.option("--cont", "cont_tokens", default=128, show_default=True)
@click.option("--ratio", default=5.0, show_default=True)
@click.option("--configs", "configs_text", default="default", show_default=True, help="name=k=v,k=v;...")
@click.option(
    "--mse", "mse_rules", default="", help="reconstruction rules to compare by weighted MSE, e.g. centre,laplace"
)
@click.option("--cache", type=click.Path(path_type=Path), default=None, help="folder caching the recomputed KV")
@click.option("--append/--no-append", default=False, help="add to the records already in --out.json")
@click.option("--merge", default="", help="only merge these result JSONs (comma-separated) into --out")
@click.option("--note", "notes", multiple=True, help="with --merge: a paragraph for the markdown")
@click.option("--out", "out_stem", required=True)
def main(
    model_name,
    kvt,
    eval_texts,
    prefix_tokens,
    cont_tokens,
    ratio,
    configs_text,
    mse_rules,
    cache,
    append,
    merge,
    notes,
    out_stem,
):
    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.models import load_model

    if merge:
        doc = _merged([json.loads(Path(p).read_text()) for p in merge.split(",")])
        doc["notes"] = list(notes)
        doc["partial"] = False  # a merge says in its notes what was left out
        doc["command"] += " ; python " + shlex.join(sys.argv)
        return _write(doc, out_stem)
    if not kvt:
        raise click.BadParameter("--kvt is needed to measure", param_hint="--kvt")
    evals = eval_texts.split(",")
    if set((TransformCodec(kvt).cal.info or {}).get("sources", [])) & set(evals):
        raise click.BadParameter("evaluation texts must not be calibration texts")
    t0 = time.perf_counter()
    model, tok = load_model(model_name)
    items = _items(model, tok, evals, prefix_tokens, cont_tokens, cache, model_name)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    old = json.loads(Path(out_stem + ".json").read_text()) if append and Path(out_stem + ".json").exists() else {}
    doc = dict(
        command=" ; ".join(filter(None, [old.get("command"), "python " + shlex.join(sys.argv)])),
        machine=f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        commit=commit,
        setup=(
            f"Held-out essays {', '.join(evals)} ({prefix_tokens}-token prefix, {cont_tokens}-token teacher-forced "
            f"continuation, {len(evals) * (cont_tokens - 1)} scored tokens per model); .kvt calibrated on other texts "
            f"(`kvcodec calibrate --model M --texts pg/addiction,pg/aord,pg/apple,pg/avg`); every config at target "
            f"ratio {ratio:g} (the size search counts fp16 sink tokens and finer tail tokens)."
        ),
        records=old.get("records", []),
        mse=old.get("mse", []),
        partial=True,
    )
    if mse_rules:
        codec = TransformCodec(kvt, target_ratio=ratio, coder="zstd")
        for it in items:
            by_rule = weighted_mse(codec, it["kv"].to(torch.float16), mse_rules.split(","))
            doc["mse"].append(dict(model=model_name, text=it["name"], ratio=ratio, by_rule=by_rule))
            click.echo(json.dumps(doc["mse"][-1]), err=True)
        _write(doc, out_stem)
    for name, opts in _configs(configs_text):
        codec = TransformCodec(kvt, target_ratio=ratio, **opts)
        rec = _evaluate(model, items, codec, f"transform-r{ratio:g}-{name}", measure=kl_measure)
        doc["records"].append(dict(model=model_name, config=name, options=opts, codec_id=codec.id, **rec))
        _write(doc, out_stem)
    doc["partial"] = False
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    _write(doc, out_stem)


if __name__ == "__main__":
    main()
