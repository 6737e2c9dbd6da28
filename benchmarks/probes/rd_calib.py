#!/usr/bin/env python3
"""Calibration size, measured: does a transform calibrated on more texts (and the larger layer
groups they allow) restore held-out KV more accurately at the same size?

    nice -n 5 python benchmarks/probes/rd_calib.py --model smollm2-135m --configs n4,n8,n16 \
        --out benchmarks/results/rd-calib-size-cpu

The model is loaded once; the KV of the first N texts of POOL is extracted once; every
configuration is then fitted and evaluated as in rd_weights.py (held-out essays, 512-token prefix,
teacher-forced continuation, one target ratio, Fisher weights alpha 1). A configuration is
`n<N>` [`:t<tokens per dim>`] [`:g<max layers per group>`] [`:lw` (Ledoit-Wolf covariance)]
[`:f<texts for the Fisher>`, default 4]. Per configuration, besides top-1 / perplexity:
- kl: mean KL(recomputed || restored) of the next-token distributions over the scored tokens;
- fisher_err: the second-order KL the restored KV's error predicts, 0.5 sum_c F_c sum_t e_ct^2 per
  scored token, with F the diagonal Fisher measured on the held-out essays themselves (a judge
  only; it never enters a calibration);
- the .kvt bytes, the layer groups, and restore FLOPs per token (sum over (group, K|V) of
  2 * group dims * coded coordinates at the level each text was coded at, averaged over texts).
Results from every model run are merged into OUT.json and OUT.md (one section per model).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rd_weights import _commit, _eval_items, _evaluate  # noqa: E402

from kvcodec.transform.calibration import CALIBRATION_POOL, HELD_OUT_TEXTS  # noqa: E402

POOL = [t.removeprefix("pg/") for t in CALIBRATION_POOL]
EVAL = [t.removeprefix("pg/") for t in HELD_OUT_TEXTS]
FISHER_PREFIX, FISHER_CONT = 512, 128


@dataclasses.dataclass(frozen=True)
class Config:
    texts: int
    tokens_per_dim: float = 4.0
    max_group: int | None = None
    covariance: str = "sample"
    fisher_texts: int = 4

    @classmethod
    def parse(cls, spec: str) -> Config:
        head, *opts = spec.strip().split(":")
        if not head.startswith("n"):
            raise click.BadParameter(f"{spec}: a configuration starts with n<texts>")
        kw = {"texts": int(head[1:])}
        names = {"t": ("tokens_per_dim", float), "g": ("max_group", int), "f": ("fisher_texts", int)}
        for o in opts:
            if o == "lw":
                kw["covariance"] = "ledoit-wolf"
            elif o[:1] in names:
                field, conv = names[o[:1]]
                kw[field] = conv(o[1:])
            else:
                raise click.BadParameter(f"{spec}: unknown option {o!r}")
        return cls(**kw)

    @property
    def label(self) -> str:
        parts = [f"n{self.texts}", f"t{self.tokens_per_dim:g}"]
        parts += [f"g{self.max_group}"] if self.max_group else []
        parts += ["lw"] if self.covariance != "sample" else []
        return ":".join(parts + [f"f{self.fisher_texts}"])


def _fisher_per_text(model, seqs, samples=2):
    from kvcodec.integrations.hf_fisher import fisher_diagonal

    return [fisher_diagonal(model, [s], FISHER_PREFIX, samples=samples) for s in seqs]


def _measure(codec, judge):
    """The per-text extras of _evaluate: KL from logits, Fisher-predicted KL, restore FLOPs."""

    def measure(it, restored, logp, chunks):
        ref = it["logp"].double()
        kl = float((ref.exp() * (ref - logp.double())).sum())
        err2 = (restored - it["kv"]).double().pow(2).sum(2)  # (layers, 2, heads, dim)
        theta = codec.header(chunks[0].blobs[0])["theta"]
        counts = codec.plan(theta).counts
        dims = [len(g) * codec.cal.layer_dim for g in codec.cal.groups for _ in (0, 1)]
        flops = sum(2 * d * c for d, c in zip(dims, counts))
        n = it["cont"].numel() - 1
        return {"kl": kl, "fisher_err": 0.5 * float((judge * err2).sum()), "flops_per_token": flops * n}

    return measure


def _run_config(cfg, model_name, model, kvs, fishers, rope, items, judge, ratio, kvt_dir):
    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.transform import calibrate, save_kvt
    from kvcodec.transform.weights import channel_weights

    fisher = torch.stack(fishers[0 : cfg.fisher_texts]).mean(0)
    w = channel_weights(fisher, rope_style=rope.style, rotary_dim=rope.rotary_dim, alpha=1.0)
    t0 = time.perf_counter()
    cal = calibrate(
        kvs[: cfg.texts],
        rope,
        tokens_per_dim=cfg.tokens_per_dim,
        max_group=cfg.max_group,
        weights=w,
        covariance=cfg.covariance,
        info={"model": model_name, "sources": [f"pg/{t}" for t in POOL[: cfg.texts]], "weights": "fisher"},
    )
    fit_s = time.perf_counter() - t0
    path = kvt_dir / f"{model_name}-{cfg.label.replace(':', '-')}.kvt"
    digest = save_kvt(cal, path)
    codec = TransformCodec(cal, kvt_hash=digest, target_ratio=ratio)
    rec = _evaluate(model, items, codec, f"transform-hevc-r{ratio:g}-{cfg.label}", _measure(codec, judge))
    return dict(
        config=dataclasses.asdict(cfg),
        label=cfg.label,
        calib_tokens=cal.info["tokens"],
        groups=[len(g) for g in cal.groups],
        kvt_bytes=path.stat().st_size,
        kvt_path=str(Path(os.path.relpath(path, Path.cwd()))),
        fit_seconds=round(fit_s, 1),
        **rec,
    )


def _write(out_stem, model_name, section):
    """Merge this model's section into OUT.json and re-render OUT.md from every section."""
    jpath = Path(out_stem + ".json")
    doc = json.loads(jpath.read_text()) if jpath.is_file() else {"runs": {}}
    doc["runs"][model_name] = section
    jpath.write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["# Transform codec: calibration size, layer groups and covariance estimator (CPU)", ""]
    for name, sec in doc["runs"].items():
        lines += [
            f"## {name}",
            "",
            f"Command: `{sec['command']}`",
            "",
            f"Machine: {sec['machine']}; commit {sec['commit']}; load average {sec['load_average']}"
            + (" (partial: stopped before every configuration ran)" if sec.get("partial") else ""),
            "",
            f"Calibration pool (first N): {' '.join(POOL[: sec['pool_texts']])}; Fisher weights alpha 1. "
            f"Evaluated on {', '.join(sec['eval_texts'])} ({sec['prefix_tokens']}-token prefix, "
            f"{sec['cont_tokens']}-token teacher-forced continuation), target {sec['ratio']:g}x. "
            "kl: mean KL(recomputed || restored) per scored token; fisher_err: the KL the restored KV's "
            "error predicts to second order (Fisher of "
            + ("the held-out essays" if sec.get("judge", "eval") == "eval" else "the first 4 calibration texts")
            + "); FLOPs: restore GEMM per token; fit s: PCA fit wall time under the load noted.",
            "",
            "| config | calib tokens | groups | .kvt MB | restore MFLOP/token | ratio | top-1 | agree | ppl % "
            "| kl (1e-3 nats) | fisher_err (1e-3) | fit s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sec["records"]:
            lines.append(
                f"| {r['label']} | {r['calib_tokens']} | {'/'.join(map(str, sorted(set(r['groups']))))} x {len(r['groups'])} "
                f"| {r['kvt_bytes'] / 1e6:.1f} | {r['flops_per_token'] / 1e6:.1f} | {r['ratio_vs_fp16']:.2f}x "
                f"| {r['top1_agreement']:.4f} | {r['agree']} / {r['tokens_scored']} | {r['ppl_delta_pct']:+.2f} "
                f"| {1e3 * r['kl']:.3f} | {1e3 * r['fisher_err']:.3f} | {r['fit_seconds']:.0f} |"
            )
        lines.append("")
    Path(out_stem + ".md").write_text("\n".join(lines))


class FisherCache:
    """Per-text diagonal Fisher of the calibration pool, measured on first use (the expensive part)."""

    def __init__(self, model, pool_ids, samples=2):
        self.model, self.pool_ids, self.samples, self.done, self.seconds = model, pool_ids, samples, [], 0.0

    def __getitem__(self, part: slice):
        t0 = time.perf_counter()
        while len(self.done) < part.stop:
            ids = self.pool_ids[len(self.done)][: FISHER_PREFIX + FISHER_CONT]
            self.done += _fisher_per_text(self.model, [ids], self.samples)
        self.seconds += time.perf_counter() - t0
        return self.done[part]


@click.command()
@click.option("--model", "model_name", default="smollm2-135m", show_default=True)
@click.option("--configs", default="n4,n8,n16", show_default=True, help="Comma-separated, see the module doc.")
@click.option("--calib-tokens", default=1024, show_default=True, help="Tokens per calibration text.")
@click.option("--prefix", "prefix_tokens", default=512, show_default=True)
@click.option("--cont", "cont_tokens", default=128, show_default=True)
@click.option("--ratio", default=5.0, show_default=True)
@click.option(
    "--judge",
    type=click.Choice(["eval", "calib"]),
    default="eval",
    show_default=True,
    help="Fisher of fisher_err: measured on the held-out essays, or the first 4 calibration texts' (cheaper).",
)
@click.option("--judge-samples", default=2, show_default=True, help="Fisher draws per held-out text (--judge eval).")
@click.option("--kvt-dir", default=".scratch_h1", show_default=True, help="Where the fitted .kvt files go.")
@click.option("--out", "out_stem", required=True)
def main(model_name, configs, calib_tokens, prefix_tokens, cont_tokens, ratio, judge, judge_samples, kvt_dir, out_stem):
    from kvcodec.integrations.hf import extract_kv
    from kvcodec.models import load_model
    from kvcodec.models.texts import load_text
    from kvcodec.transform import RopeSpec

    cfgs = [Config.parse(c) for c in configs.split(",")]
    n_pool = max(c.texts for c in cfgs)
    n_extract = max(n_pool, 4, *(c.fisher_texts for c in cfgs))
    if n_extract > len(POOL) or set(POOL) & set(EVAL):
        raise click.BadParameter(f"the calibration pool has {len(POOL)} texts, none of them evaluation texts")
    Path(kvt_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, tok = load_model(model_name)
    rope = RopeSpec.from_hf_config(model.config)
    timing = {"load_s": round(time.perf_counter() - t0, 1)}
    t0 = time.perf_counter()
    ids_kv = [extract_kv(model, tok, load_text(f"pg/{t}"), calib_tokens) for t in POOL[:n_extract]]
    kvs = [kv for _, kv in ids_kv]
    timing["extract_s"] = round(time.perf_counter() - t0, 1)
    fishers = FisherCache(model, [ids for ids, _ in ids_kv])
    items = _eval_items(model, tok, [f"pg/{t}" for t in EVAL], prefix_tokens, cont_tokens)
    t0 = time.perf_counter()
    if judge == "eval":
        seqs = [torch.cat([it["prefix"], it["cont"]]) for it in items]
        judge_f = torch.stack(_fisher_per_text(model, seqs, judge_samples)).mean(0)
    else:
        judge_f = torch.stack(fishers[:4]).mean(0)
    timing["fisher_judge_s"] = round(time.perf_counter() - t0, 1)
    click.echo(json.dumps(timing), err=True)
    section = dict(
        command="nice -n 5 python " + shlex.join(sys.argv),
        machine=f"cpu ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)",
        commit=_commit(),
        load_average=" ".join(f"{x:.1f}" for x in os.getloadavg()),
        pool_texts=n_pool,
        eval_texts=[f"pg/{t}" for t in EVAL],
        prefix_tokens=prefix_tokens,
        cont_tokens=cont_tokens,
        ratio=ratio,
        timing=timing,
        judge=judge,
        judge_samples=judge_samples if judge == "eval" else None,
        records=[],
        partial=True,
    )
    for cfg in cfgs:
        section["records"].append(
            _run_config(cfg, model_name, model, kvs, fishers, rope, items, judge_f, ratio, Path(kvt_dir))
        )
        section["load_average"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
        timing["fisher_calib_s"] = round(fishers.seconds, 1)
        _write(out_stem, model_name, section)
    section["partial"] = False
    _write(out_stem, model_name, section)


if __name__ == "__main__":
    main()
