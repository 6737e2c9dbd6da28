"""`kvcodec calibrate`: fit a transform (.kvt) on KV files or on a registered model's texts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from kvcodec.errors import ConfigError, ShapeError
from kvcodec.transform.calibration import CALIBRATION_POOL, HELD_OUT_TEXTS
from kvcodec.transform.pca import COVARIANCES, MIN_TOKENS_PER_DIM, TARGET_TOKENS_PER_DIM
from kvcodec.transform.rope import STYLES, RopeSpec

SENSITIVITY_PREFIX, SENSITIVITY_CONT = 512, 128  # the Fisher's prefix and scored continuation per text
SENSITIVITY_TEXTS = 4  # the Fisher runs on the first texts only: it is the expensive part (rd-calib-size-cpu.md)
WEIGHT_ALPHA = 1.0  # weights = Fisher ** alpha; 1 (the second-order KL) measured best (docs/TRANSFORM.md)
DEFAULT_TEXT_COUNT = 16  # texts of CALIBRATION_POOL used without --texts (benchmarks/results/rd-calib-size-cpu.md)
DEFAULT_TEXTS = CALIBRATION_POOL[:DEFAULT_TEXT_COUNT]


def rope_for_model(name: str) -> RopeSpec:
    """A registered model's rotary settings, from its cached config (or by loading it once)."""
    from kvcodec.models import get_spec, load_model
    from kvcodec.models.registry import model_cache_path

    get_spec(name)
    folder = model_cache_path(name)
    if (folder / "config.json").is_file():
        from transformers import AutoConfig

        return RopeSpec.from_hf_config(AutoConfig.from_pretrained(str(folder)))
    model, _ = load_model(name)
    return RopeSpec.from_hf_config(model.config)


def resolve_rope(metadata: dict, theta, style, rotary_dim, no_rope) -> RopeSpec | None:
    """Rotary settings: --no-rope, else the KV file's 'rope' metadata, else flags, else the
    registered model named in the file's metadata. None if nothing says."""
    if no_rope:
        return None
    if metadata.get("rope"):
        return RopeSpec.from_dict(json.loads(metadata["rope"]))
    head_dim = int(metadata["head_dim"])
    if theta is not None:
        return RopeSpec(theta, head_dim, rotary_dim, style)
    if metadata.get("model"):
        return rope_for_model(metadata["model"])
    raise ConfigError("the KV files do not say their model's rotary settings: pass --rope-theta (or --no-rope)")


def _load_kv_files(paths) -> tuple[list, dict]:
    from safetensors import SafetensorError, safe_open

    kvs, metas = [], []
    for p in paths:
        try:
            with safe_open(str(p), "pt") as f:
                if "kv" not in f.keys():  # noqa: SIM118 - safe_open has no __contains__
                    raise ShapeError(f"{p} holds no tensor named 'kv'")
                kvs.append(f.get_tensor("kv"))
                metas.append(dict(f.metadata() or {}))
        except (OSError, ValueError, SafetensorError) as e:  # the parser's own type for damaged files
            raise ConfigError(f"{p}: not a readable safetensors KV file ({e})") from e
    models = {m.get("model") for m in metas}
    if len(models) > 1:
        raise ConfigError(f"KV files come from different models: {sorted(map(str, models))}")
    meta = dict(metas[0])
    if any(m.get("text") for m in metas):
        meta["sources"] = [m.get("text", str(p)) for m, p in zip(metas, paths)]
    return kvs, meta


def _kv_from_model(name: str, texts: str, max_tokens: int, sensitivity: int, sink_tokens: int) -> tuple[list, dict]:
    """KV of the texts; with sensitivity > 0, also the model's diagonal Fisher on the first `sensitivity` texts
    long enough for it (meta['fisher'])."""
    from kvcodec.cli.extract import _read_text
    from kvcodec.integrations.hf import extract_kv
    from kvcodec.models import load_model

    model, tokenizer = load_model(name)
    kvs, sources, ids = [], [], []
    for spec in texts.split(","):
        text, label = _read_text(spec.strip())
        tokens, kv = extract_kv(model, tokenizer, text, max_tokens)
        kvs.append(kv)
        sources.append(label)
        ids.append(tokens)
    rope = RopeSpec.from_hf_config(model.config)
    meta = {"model": name, "sources": sources, "rope": json.dumps(rope.to_dict())}
    if sensitivity:
        meta["fisher"] = _fisher(model, ids, sink_tokens, sensitivity)
    return kvs, meta


def _fisher(model, ids: list, sink_tokens: int, count: int):
    """Diagonal Fisher on the first `count` usable texts' first SENSITIVITY_PREFIX tokens followed by SENSITIVITY_CONT."""
    from kvcodec.integrations.hf_fisher import fisher_diagonal

    usable = [t[: SENSITIVITY_PREFIX + SENSITIVITY_CONT] for t in ids if t.numel() > SENSITIVITY_PREFIX + 1]
    if not usable:
        raise ConfigError(
            f"--weights fisher needs texts longer than {SENSITIVITY_PREFIX + 1} tokens (raise --max-tokens)"
        )
    return fisher_diagonal(model, usable[:count], SENSITIVITY_PREFIX, sink_tokens=sink_tokens)


@click.command("calibrate")
@click.argument("kv_files", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--out", "out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="MODEL.kvt to write."
)
@click.option("--model", "model_name", help="Registered model: extract its KV from --texts instead of KV files.")
@click.option(
    "--texts",
    help=f"Comma-separated texts for --model (files or pg/<essay>); never the texts you evaluate on. Default: "
    f"{DEFAULT_TEXT_COUNT} essays, {DEFAULT_TEXTS[0]} .. {DEFAULT_TEXTS[-1]} (none of the held-out evaluation essays "
    f"{', '.join(HELD_OUT_TEXTS)}).",
)
@click.option(
    "--max-tokens", type=click.IntRange(min=1), default=1024, show_default=True, help="Tokens per text (--model)."
)
@click.option("--rope-theta", type=float, help="Rotary base, when the KV files do not carry their model's settings.")
@click.option("--rope-style", type=click.Choice(STYLES), default="half", show_default=True)
@click.option("--rotary-dim", type=int, help="Rotated channels per head (partial rotary); default the whole head.")
@click.option("--no-rope", is_flag=True, help="Fit the keys as stored (with RoPE).")
@click.option(
    "--sink-tokens",
    type=click.IntRange(min=0),
    default=4,
    show_default=True,
    help="Leading tokens left out of the fit.",
)
@click.option("--max-group", type=click.IntRange(min=1), help="At most this many layers per PCA group.")
@click.option(
    "--tokens-per-dim",
    type=click.FloatRange(min=MIN_TOKENS_PER_DIM),
    default=TARGET_TOKENS_PER_DIM,
    show_default=True,
    help="Calibration tokens per dimension a layer group must keep (fewer: larger groups).",
)
@click.option(
    "--covariance",
    type=click.Choice(sorted(COVARIANCES)),
    default="sample",
    show_default=True,
    help="Covariance estimator of the PCA (ledoit-wolf: shrunk toward the diagonal).",
)
@click.option(
    "--weights",
    "weighting",
    type=click.Choice(["fisher", "mse"]),
    default="fisher",
    show_default=True,
    help="fisher: weight channels by the model's sensitivity (needs --model); mse: plain squared error.",
)
@click.option("--weight-alpha", type=click.FloatRange(0.0, 1.0), default=WEIGHT_ALPHA, show_default=True)
@click.option(
    "--fisher-texts",
    type=click.IntRange(min=1),
    default=SENSITIVITY_TEXTS,
    show_default=True,
    help="The Fisher weights are measured on the first this many texts (the expensive part of calibration).",
)
def command(
    kv_files,
    out,
    model_name,
    texts,
    max_tokens,
    rope_theta,
    rope_style,
    rotary_dim,
    no_rope,
    sink_tokens,
    max_group,
    tokens_per_dim,
    covariance,
    weighting,
    weight_alpha,
    fisher_texts,
):
    """Learn a transform (a mean and a PCA basis per group of layers, for K and V) from
    KV_FILES (written by `kvcodec extract`) or from --model on --texts (by default a fixed set of calibration
    essays, none of them an evaluation essay: see --texts); write it to OUT.kvt."""
    from kvcodec.transform import calibrate, save_kvt

    if bool(kv_files) == bool(model_name):
        raise click.UsageError("give either KV files or --model (with --texts or the default texts)")
    if texts and not model_name:
        raise click.UsageError("--texts needs --model")
    texts = texts or ",".join(DEFAULT_TEXTS)
    held_out = sorted({t.strip() for t in texts.split(",")} & set(HELD_OUT_TEXTS))
    if model_name and held_out:
        click.echo(f"warning: calibrating on {', '.join(held_out)}, which the project evaluates on", err=True)
    if out.suffix != ".kvt":
        raise click.BadParameter(f"{out}: the output name must end in .kvt", param_hint="--out")
    t0 = time.perf_counter()
    weighted = weighting == "fisher" and bool(model_name) and weight_alpha > 0
    if model_name:
        kvs, meta = _kv_from_model(model_name, texts, max_tokens, fisher_texts if weighted else 0, sink_tokens)
    else:
        kvs, meta = _load_kv_files(kv_files)
    meta["head_dim"] = str(kvs[0].shape[-1])
    rope = resolve_rope(meta, rope_theta, rope_style, rotary_dim, no_rope)
    info = {"model": meta.get("model"), "model_id": meta.get("model_id"), "sources": meta.get("sources", [])}
    w = None
    if weighted:
        from kvcodec.transform.weights import channel_weights

        style = None if rope is None else rope.style
        w = channel_weights(
            meta["fisher"], rope_style=style, rotary_dim=None if rope is None else rope.rotary_dim, alpha=weight_alpha
        )
        info.update(weights="fisher", weight_alpha=weight_alpha, fisher_texts=fisher_texts)
    cal = calibrate(
        kvs,
        rope,
        sink_tokens=sink_tokens,
        tokens_per_dim=tokens_per_dim,
        max_group=max_group,
        weights=w,
        covariance=covariance,
        info=info,
    )
    digest = save_kvt(cal, out)
    sizes = sorted({len(g) for g in cal.groups})
    click.echo(
        f"{out}: {len(cal.groups)} layer groups of {'/'.join(map(str, sizes))} layers from {cal.info['tokens']} tokens, "
        f"rope {'off' if rope is None else f'theta={rope.theta:g} {rope.style}'}, "
        f"{'Fisher-weighted' if w is not None else 'plain MSE'}, sha256 {digest[:16]}, "
        f"{time.perf_counter() - t0:.1f} s"
    )
