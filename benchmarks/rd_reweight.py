#!/usr/bin/env python3
"""Refit a Fisher-weighted .kvt at another weight exponent without recomputing the Fisher:

    python benchmarks/rd_reweight.py IN.kvt OUT.kvt --alpha 1

`kvcodec calibrate` stores w = g**a / mean(g**a) per channel (g: the floored, RoPE-pair-averaged
diagonal Fisher; a: --weight-alpha). Then g**b / mean(g**b) = w**(b/a) / mean(w**(b/a)) exactly, so
the weights of exponent b follow from the file (up to its float32 rounding), and the transform is
refitted on the KV of the same texts (re-extracted from the file's model), as `kvcodec calibrate
--weight-alpha b` would fit it. The Fisher pass, most of a calibration's time on the CPU, is skipped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import torch


def weights_tensor(cal) -> torch.Tensor:
    """(layers, 2, heads, dim) channel weights gathered from a calibration's group bases."""
    from kvcodec.transform.calibration import KINDS

    w = torch.empty(cal.layers, 2, cal.kv_heads, cal.head_dim, dtype=torch.float64)
    for g, layers in enumerate(cal.groups):
        for ki, kind in enumerate(KINDS):
            b = cal.basis(g, kind)
            if b.weights is None:
                raise click.ClickException("the .kvt carries no channel weights (a plain-MSE transform)")
            w[list(layers), ki] = b.weights.to(torch.float64).reshape(len(layers), cal.kv_heads, cal.head_dim)
    return w


def reweighted(w: torch.Tensor, alpha_from: float, alpha_to: float) -> torch.Tensor:
    v = w ** (alpha_to / alpha_from)
    return v / v.mean()


@click.command()
@click.argument("src", type=click.Path(exists=True, dir_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--alpha", type=click.FloatRange(min=0.0, min_open=True), required=True)
@click.option("--max-tokens", default=1024, show_default=True, help="Tokens per text, as the source was made.")
def main(src, out, alpha, max_tokens):
    from kvcodec.integrations.hf import extract_kv
    from kvcodec.models import load_model
    from kvcodec.models.texts import load_text
    from kvcodec.transform import RopeSpec, calibrate, load_kvt, save_kvt

    cal, _ = load_kvt(src)
    a = float(cal.info.get("weight_alpha", 0))
    if cal.info.get("weights") != "fisher" or not a > 0:
        raise click.ClickException(f"{src} is not a Fisher-weighted transform (info {cal.info})")
    w = reweighted(weights_tensor(cal), a, alpha)
    model, tokenizer = load_model(cal.info["model"])
    kvs = [extract_kv(model, tokenizer, load_text(s), max_tokens)[1] for s in cal.info["sources"]]
    info = {k: cal.info.get(k) for k in ("model", "model_id", "sources")}
    info.update(weights="fisher", weight_alpha=alpha, reweighted_from=a)
    new = calibrate(
        kvs, RopeSpec.from_hf_config(model.config), sink_tokens=int(cal.info["sink_tokens"]), weights=w, info=info
    )
    digest = save_kvt(new, out)
    click.echo(f"{out}: alpha {a:g} -> {alpha:g}, {len(new.groups)} groups, sha256 {digest[:16]}", err=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
