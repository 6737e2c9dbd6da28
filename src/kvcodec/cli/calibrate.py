"""`kvcodec calibrate`: fit a transform (.kvt) on KV files or on a registered model's texts."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from kvcodec.cli.options import FiniteRange, check_output_path, device_option
from kvcodec.errors import ConfigError, ShapeError
from kvcodec.transform.calibration import HELD_OUT_TEXTS, KIND_EVAL_TEXTS, mixed_texts
from kvcodec.transform.pca import COVARIANCES, MIN_TOKENS_PER_DIM, TARGET_TOKENS_PER_DIM
from kvcodec.transform.quality import REPORT_RATIOS, safe_ratio, summary
from kvcodec.transform.rope import STYLES, RopeSpec

SENSITIVITY_PREFIX, SENSITIVITY_CONT = 512, 128  # the Fisher's prefix and scored continuation per text
SENSITIVITY_TEXTS = 4  # the Fisher runs on the first texts only: it is the expensive part (rd-calib-size-cpu.md)
WEIGHT_ALPHA = 1.0  # weights = Fisher ** alpha; 1 (the second-order KL) measured best (docs/TRANSFORM.md)
# Without --texts: 16 texts (benchmarks/results/rd-calib-size-cpu.md) of three kinds, 8 essays, 4 Python
# sources, 4 pydoc pages, interleaved (the Fisher's first texts hold every kind): essays alone coded
# code and documentation worse (benchmarks/results/rd-smollm2-135m-cpu-kinds-mixcal.md, -essaycal.md, issue 23 target 3).
DEFAULT_TEXTS = mixed_texts(8, 4, 4)
DEFAULT_TEXT_COUNT = len(DEFAULT_TEXTS)
HOLDOUT_TEXTS = ("pg/goodtaste", "py/shlex", "doc/csv")  # held out of the default fit: one text of each kind


def rope_for_model(name: str) -> RopeSpec:
    """A model's one rotary setting (registered name, directory or .gguf), from its config alone."""
    from kvcodec.models.check import inspect_model

    return inspect_model(name).uniform_rope


def resolve_rope(metadata: dict, theta, style, rotary_dim, no_rope) -> RopeSpec | None:
    """Rotary settings: --no-rope, else the KV file's 'rope' metadata, else flags, else the
    model named in the file's metadata. ConfigError if nothing says."""
    if no_rope:
        return None
    if metadata.get("rope"):
        _refuse_rope_flags(theta, rotary_dim, style)
        return RopeSpec.from_dict(_metadata_json(metadata, "rope"))
    head_dim = int(metadata["head_dim"])
    if theta is not None:
        return RopeSpec(theta, head_dim, rotary_dim, style or "half")
    if metadata.get("model"):
        return rope_for_model(metadata["model"])
    raise ConfigError("the KV files do not say their model's rotary settings: pass --rope-theta (or --no-rope)")


def _metadata_json(metadata: dict, key: str):  # noqa: ANN202 - the parsed JSON value
    try:
        return json.loads(metadata[key])
    except ValueError as e:
        raise ConfigError(f"the KV file's {key!r} metadata is not JSON: {e}") from e


def _refuse_rope_flags(theta, rotary_dim, style) -> None:  # noqa: ANN001
    """The KV files carry their rotary settings: flags that would not be used are refused, not ignored."""
    if theta is not None or rotary_dim is not None or style is not None:
        raise ConfigError(
            "the KV files carry their model's rotary settings: leave out --rope-theta / --rotary-dim / --rope-style"
        )


def group_ropes(spec, metadata: dict, theta, style, rotary_dim, no_rope) -> list[RopeSpec | None]:
    """Per group of a grouped KV file: its keys' rotary settings (the file's per-layer 'ropes', else
    --rope-theta for every full-kv group, else the model named in the metadata)."""
    if no_rope:
        return [None] * len(spec.groups)
    if metadata.get("ropes"):
        _refuse_rope_flags(theta, rotary_dim, style)
        ropes = _metadata_json(metadata, "ropes")
        if not isinstance(ropes, list) or len(ropes) != len(spec.layers):
            what = f"{len(ropes)} entries" if isinstance(ropes, list) else f"a {type(ropes).__name__}"
            raise ConfigError(f"the KV file's 'ropes' metadata is {what}, not one per layer ({len(spec.layers)})")
        per_layer = [RopeSpec.from_dict(r) if r else None for r in ropes]
    elif theta is not None:
        per_layer = [RopeSpec(theta, x.k_shape[1], rotary_dim, style or "half") for x in spec.layers]
    elif metadata.get("model"):
        from kvcodec.models.check import inspect_model

        per_layer = list(inspect_model(metadata["model"]).ropes)
    else:
        raise ConfigError("the KV files do not say their model's rotary settings: pass --rope-theta (or --no-rope)")
    out = []
    for g in spec.groups:
        ropes = {per_layer[i] for i in g.layers}
        if g.kind == "mla" or g.stream != "kv" or ropes == {None}:
            out.append(None)
        elif len(ropes) != 1:
            raise ConfigError(f"layers {g.layers} of group {g.name} use different RoPE settings")
        else:
            out.append(ropes.pop())
    return out


def _load_kv_files(paths) -> tuple[list, dict]:
    from kvcodec.kvspec import GroupedKV
    from kvcodec.kvspec.files import load_kv_file

    kvs, metas = [], []
    for p in paths:
        kv, meta = load_kv_file(p)
        if not isinstance(kv, GroupedKV) and (kv.dim() != 5 or kv.shape[1] != 2):  # said before any rope question
            raise ShapeError(f"{p} holds KV of shape {tuple(kv.shape)}, not (layers, 2, tokens, kv_heads, head_dim)")
        kvs.append(kv)
        metas.append(meta)
    models = {m.get("model") for m in metas}
    if len(models) > 1:
        named = ", ".join(
            f"{p}: {m.get('model') or 'no model named (not from kvcodec extract)'}" for p, m in zip(paths, metas)
        )
        raise ConfigError(f"KV files come from different models: {named}")
    if len({type(k).__name__ for k in kvs}) > 1 or len({getattr(k, "spec", None) for k in kvs}) > 1:
        raise ConfigError("KV files hold caches of different layouts (layer groups)")
    meta = dict(metas[0])
    if any(m.get("text") for m in metas):
        meta["sources"] = [m.get("text", str(p)) for m, p in zip(metas, paths)]
    return kvs, meta


def _kv_from_model(model, tokenizer, layout, texts: list[str], max_tokens: int, keep: int = 0) -> tuple:
    """(KV per text, labels, token ids per text, prefixes): prefixes are the model-precision KV of the
    first SENSITIVITY_PREFIX tokens of the first `keep` texts the Fisher can use (_fisher), so that it
    does not run them again (the extraction's first 512-token chunk is that prefix, computed alike)."""
    import torch

    from kvcodec.cli.extract import _read_text
    from kvcodec.models.extract import extract_text_kv

    kvs, sources, ids, prefixes = [], [], [], []
    for spec in texts:
        text, label = _read_text(spec)
        tokens, kv = extract_text_kv(model, tokenizer, layout, text, max_tokens, chunk_tokens=SENSITIVITY_PREFIX)
        if isinstance(kv, torch.Tensor) and len(prefixes) < keep and tokens.numel() > SENSITIVITY_PREFIX + 1:
            prefixes.append(kv[:, :, :SENSITIVITY_PREFIX].clone())
        kvs.append(kv.to(torch.float16) if isinstance(kv, torch.Tensor) else kv)  # as a store holds it; half the memory
        sources.append(label)
        ids.append(tokens)
    return kvs, sources, ids, prefixes


def _fisher(model, ids: list, sink_tokens: int, count: int, prefixes: list | None = None):
    """Diagonal Fisher on the first `count` usable texts' first SENSITIVITY_PREFIX tokens followed by
    SENSITIVITY_CONT (prefixes: those texts' prefix KV, from _kv_from_model)."""
    from kvcodec.integrations.hf_fisher import fisher_diagonal

    usable = [t[: SENSITIVITY_PREFIX + SENSITIVITY_CONT] for t in ids if t.numel() > SENSITIVITY_PREFIX + 1]
    if not usable:
        click.echo(
            f"warning: the Fisher weights need texts longer than {SENSITIVITY_PREFIX + 1} tokens (raise --max-tokens); "
            "fitting with plain MSE",
            err=True,
        )
        return None
    usable = usable[:count]
    prefixes = prefixes if prefixes and len(prefixes) == len(usable) else None
    return fisher_diagonal(model, usable, SENSITIVITY_PREFIX, sink_tokens=sink_tokens, prefix_kvs=prefixes)


def resolve_device(device: str | None) -> Any:
    """The torch device --model runs on: --device (checked by cli.options.check_device), else cuda
    where there is one, else cpu."""
    import torch

    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


@contextlib.contextmanager
def gpu_memory_hint(device: Any, model_name: str | None) -> Iterator[None]:
    """A GPU out-of-memory error inside (loading, extraction, the Fisher, the fit, the report) as a
    one-line ConfigError that names the fix, instead of a traceback."""
    import torch

    try:
        yield
    except torch.cuda.OutOfMemoryError:
        if device is None or device.type != "cuda":
            raise
        gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        raise ConfigError(
            f"calibrating {model_name} ran out of memory on {device} ({gib:.0f} GiB): run it on the CPU with "
            "--device cpu (slower), or lower --max-tokens"
        ) from None


def split_held_out(items: list, holdout: int | None) -> tuple[list, list]:
    """(fit, held out): the last `holdout` items (default: one in eight, at least one when there are three)."""
    n = len(items)
    if holdout is not None and holdout > max(0, n - 1):
        raise click.BadParameter(f"{holdout} of {n}: at least one must be fitted", param_hint="--holdout")
    k = (max(1, n // 8) if n >= 3 else 0) if holdout is None else holdout
    return (items[: n - k], items[n - k :]) if k > 0 else (items, [])


MIN_HELD_OUT_TOKENS = 32  # beyond the sink tokens: fewer measure no ratio (a few tokens are stored whole)


def check_held_out(fitted: list[str], held: list[str], held_tokens: list[int], sink_tokens: int) -> None:
    """Refuse a quality report that would not be one (before the fit): check_disjoint, and a held-out
    source too short to code at any ratio. Pure."""
    check_disjoint(fitted, held)
    least = sink_tokens + MIN_HELD_OUT_TOKENS
    if short := [f"{name} ({n})" for name, n in zip(held, held_tokens) if n < least]:
        raise click.BadParameter(
            f"held-out {', '.join(short)} has fewer than {least} tokens ({sink_tokens} sink tokens + "
            f"{MIN_HELD_OUT_TOKENS}): too short to measure the quality of a ratio; hold out a longer text",
            param_hint="--holdout",
        )


def check_disjoint(fitted: list[str], held: list[str]) -> None:
    """Refuse a held-out source that is also fitted: its quality would not be held-out. Pure."""
    if both := sorted(set(fitted) & set(held)):
        raise click.BadParameter(
            f"{', '.join(both)} is both fitted and held out: its quality would not be held-out", param_hint="--holdout"
        )


def _tokens(kv) -> int:  # noqa: ANN001 - a KV tensor (layers, 2, tokens, ...) or a GroupedKV
    return int(kv.stop) if hasattr(kv, "stop") else int(kv.shape[2])


def _refuse_model_only_flags(model_name: str | None) -> None:
    """Options that need the model's gradients, given with KV files, are refused rather than ignored."""
    ctx = click.get_current_context()
    typed = [n for n in ("weighting", "weight_alpha", "fisher_texts") if ctx.get_parameter_source(n).name != "DEFAULT"]
    given = [  # `--weights mse` is what KV files are fitted with: only fisher needs the model
        "--" + n.replace("_", "-").replace("weighting", "weights")
        for n in typed
        if n != "weighting" or ctx.params.get("weighting") == "fisher"
    ]
    if given and not model_name:
        raise click.UsageError(
            f"{', '.join(given)} weight channels by the model's Fisher information and need --model; "
            "KV files are fitted with plain squared error"
        )


@click.command("calibrate")
@click.argument("kv_files", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    callback=check_output_path,
    help="MODEL.kvt to write.",
)
@click.option(
    "--model",
    "model_name",
    help="A registered model name, a transformers model directory or a .gguf file: extract its KV from --texts "
    "instead of KV files (checked in seconds before anything loads).",
)
@click.option(
    "--texts",
    help="Comma-separated texts for --model (files, pg/<essay>, py/<module> source, doc/<module> pydoc, dlg/<n> "
    f"conversation); never the texts you evaluate on. Default: {', '.join(DEFAULT_TEXTS)} (none of the evaluation "
    f"texts {', '.join(HELD_OUT_TEXTS + KIND_EVAL_TEXTS)}).",
)
@click.option(
    "--max-tokens", type=click.IntRange(min=1), default=1024, show_default=True, help="Tokens per text (--model)."
)
@click.option(
    "--rope-theta",
    type=FiniteRange(min=0, min_open=True),
    help="Rotary base, when the KV files do not carry their model's settings.",
)
@click.option(
    "--rope-style",
    type=click.Choice(STYLES),
    default=None,
    help="With --rope-theta: how the rotary pairs its channels.  [default: half]",
)
@click.option(
    "--rotary-dim",
    type=click.IntRange(min=2),
    help="Rotated channels per head (partial rotary); default the whole head.",
)
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
    type=FiniteRange(min=MIN_TOKENS_PER_DIM),
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
@click.option("--weight-alpha", type=FiniteRange(0.0, 1.0), default=WEIGHT_ALPHA, show_default=True)
@click.option(
    "--fisher-texts",
    type=click.IntRange(min=1),
    default=SENSITIVITY_TEXTS,
    show_default=True,
    help="The Fisher weights are measured on the first this many texts (the expensive part of calibration).",
)
@click.option(
    "--report-ratios",
    default=",".join(f"{r:g}" for r in REPORT_RATIOS),
    show_default=True,
    help="Target ratios (vs fp16) the held-out quality report measures.",
)
@click.option(
    "--holdout",
    type=click.IntRange(min=0),
    help=f"Texts (or KV files) held out of the fit, last ones first: the per-channel fallback is decided and the "
    f"quality report measured on them. Default: {', '.join(HOLDOUT_TEXTS)} beside the default texts; one in eight "
    "of given texts or files.",
)
@device_option(
    default=None,
    help="--model: where the model runs, with its KV extraction, Fisher and running moments (cpu, cuda, cuda:1 "
    "...; default: cuda if present). On a GPU the model runs in its own dtype, float32 weights as float16.",
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
    report_ratios,
    holdout,
    device,
):
    """Learn a transform (a mean and a PCA basis per group of layers, for K and V) from
    KV_FILES (written by `kvcodec extract`) or from --model on --texts (by default a fixed set of essays,
    Python sources and their documentation, none of them an evaluation text: see --texts); write it to OUT.kvt. Part of the texts is held
    out: blocks the basis codes worse than per-channel quantization fall back to it, and the quality per
    ratio (top-1 agreement and perplexity change with the model, relative error from KV files) is written
    into the .kvt and printed."""
    if bool(kv_files) == bool(model_name):
        raise click.UsageError("give either KV files or --model (with --texts or the default texts)")
    if texts and not model_name:
        raise click.UsageError("--texts needs --model")
    if device and not model_name:
        raise click.UsageError("--device needs --model (KV files are fitted on the CPU)")
    if model_name and (rope_theta is not None or rotary_dim is not None or rope_style is not None):
        raise click.UsageError(
            "--rope-theta / --rotary-dim / --rope-style are for KV files without rotary settings, not --model"
        )
    if rope_style is not None and rope_theta is None:
        raise click.UsageError("--rope-style goes with --rope-theta (KV files without rotary settings)")
    _refuse_model_only_flags(model_name)
    if out.suffix != ".kvt":
        raise click.BadParameter(f"{out}: the output name must end in .kvt", param_hint="--out")
    try:
        ratios = sorted({float(r) for r in report_ratios.split(",") if r.strip()})
    except ValueError:
        ratios = []
    if not ratios or not all(math.isfinite(r) and r > 1 for r in ratios):  # nan failed after the fit, inf ran
        raise click.BadParameter(
            f"{report_ratios!r}: finite ratios above 1, comma-separated", param_hint="--report-ratios"
        )
    if not model_name:
        split_held_out(list(kv_files), holdout)  # one KV a file: a --holdout beyond them is refused before they load
    t0 = time.perf_counter()
    settings = dict(sink_tokens=sink_tokens, tokens_per_dim=tokens_per_dim, max_group=max_group, covariance=covariance)
    rope_flags = (rope_theta, rope_style, rotary_dim, no_rope)
    dev = resolve_device(device) if model_name else None
    with gpu_memory_hint(dev, model_name):
        if model_name:
            fisher = (weighting, weight_alpha, fisher_texts)
            data = _model_data(model_name, texts, holdout, max_tokens, fisher, settings, no_rope, dev)
        else:
            data = _file_data(kv_files, holdout)
        check_held_out(data["meta"]["sources"], data["held_sources"], [_tokens(kv) for kv in data["held"]], sink_tokens)
        fit = _fit_grouped if data["grouped"] else _fit_uniform
        if model_name:  # minutes of work: progress lines (a fit of KV files takes seconds)
            _say("fitting the bases", t0)
        result = fit(data, settings, rope_flags, weight_alpha)
        data["kvs"] = data["stream"] = None  # fitted: the report needs only the held-out texts (bounded memory)
        coder = report_coder() if "cal" in result else "zstd"  # grouped caches: real zstd encodes
        if model_name:
            _say(f"measuring the quality at {', '.join(f'{r:g}x' for r in ratios)} on the held-out texts", t0)
        points = _quality(data, result, ratios, coder)
    report = {
        "metric": "model" if data.get("model") is not None else "kv",
        "held_out": data["held_sources"],
        "coder": coder,
        "points": points,
    }
    if report["metric"] == "model":
        from kvcodec.models.quality import QUALITY_CONT, QUALITY_PREFIX

        report.update(prefix_tokens=QUALITY_PREFIX, cont_tokens=QUALITY_CONT)  # what an evaluation must match
    if points:
        report["safe_ratio"] = safe_ratio(report)
    where = _where(data)
    digest = _save(out, data, result, report, time.perf_counter() - t0, where)
    _print_report(out, result, report, digest, time.perf_counter() - t0, where)


def _texts(texts: str | None, holdout: int | None) -> tuple[list[str], list[str]]:
    if not texts:
        if holdout is not None and holdout > len(HOLDOUT_TEXTS):
            raise click.BadParameter(
                f"{holdout}: the default holds out at most {', '.join(HOLDOUT_TEXTS)}; give --texts to hold out more",
                param_hint="--holdout",
            )
        return list(DEFAULT_TEXTS), list(HOLDOUT_TEXTS[: len(HOLDOUT_TEXTS) if holdout is None else holdout])
    return split_held_out([t.strip() for t in texts.split(",") if t.strip()], holdout)


def _read_ids(tokenizer, texts: list[str], max_tokens: int) -> tuple[list[str], list]:
    """(labels, token ids cut to max_tokens) of texts, as extract_text_kv tokenizes them."""
    from kvcodec.cli.extract import _read_text

    read = [_read_text(spec) for spec in texts]
    return [label for _, label in read], [tokenizer(t, return_tensors="pt").input_ids[0][:max_tokens] for t, _ in read]


def _say(what: str, since: float) -> None:
    """A progress line on stderr: a calibration from a model runs for minutes."""
    click.echo(f"calibrate: {what} ({time.perf_counter() - since:.0f} s)", err=True)


def _stream_from_model(model, layout, ids: list, settings: dict, rope):
    """Each text's KV (as _kv_from_model computes and keeps it) into the running moments of a
    StreamedCalibration, then dropped: the fit never holds the calibration KV. The moments are summed
    on the model's device (kv_of_ids hands the KV over on the CPU: it goes back as float16)."""
    import torch

    from kvcodec.models.extract import kv_of_ids
    from kvcodec.transform.calibration import StreamedCalibration, streamed_token_count

    tokens = streamed_token_count([t.numel() for t in ids], settings["sink_tokens"])
    shape = (len(layout.spec.layers), *layout.spec.layers[0].k_shape)  # (layers, kv heads, head dim)
    fit = {k: settings[k] for k in ("sink_tokens", "tokens_per_dim", "max_group")}
    stream = StreamedCalibration(shape, rope, tokens=tokens, **fit)
    t0 = time.perf_counter()
    for i, t in enumerate(ids):
        _say(f"KV of text {i + 1} of {len(ids)} ({t.numel()} tokens)", t0)
        kv = kv_of_ids(model, layout, t, chunk_tokens=SENSITIVITY_PREFIX)
        stream.add(kv.to(device=model.device, dtype=torch.float16))  # the values a store holds, as _kv_from_model
        del kv
    return stream


def _model_data(model_name, texts, holdout, max_tokens, fisher_args, settings, no_rope, device) -> dict:
    from kvcodec.cli.extract import _read_text
    from kvcodec.models import load_for_device, model_id
    from kvcodec.models.check import inspect_model

    layout = inspect_model(model_name)  # a model kvcodec cannot code fails here, in seconds
    fit_texts, held_texts = _texts(texts, holdout)
    check_disjoint(fit_texts, held_texts)  # in seconds, before the model loads
    held = sorted(set(fit_texts) & {*HELD_OUT_TEXTS, *KIND_EVAL_TEXTS})
    if held:
        click.echo(f"warning: calibrating on {', '.join(held)}, which the project evaluates on", err=True)
    for spec in (*fit_texts, *held_texts):  # a misspelt text fails here, not after the model loads (or the fit)
        _read_text(spec)
    t0 = time.perf_counter()
    model, tokenizer = load_for_device(model_name, device)  # as the engine runs it: float32 weights as float16 on a GPU
    _say(f"{model_name} loaded; {len(fit_texts)} texts to fit on, {len(held_texts)} held out", t0)
    weighting, alpha, fisher_texts = fisher_args
    sink_tokens = settings["sink_tokens"]
    fisher = weighting == "fisher" and alpha > 0 and layout.spec.uniform  # the Fisher of grouped caches: not yet
    stream = weights = None
    if layout.spec.uniform and settings["covariance"] == "sample":  # moments as it extracts: the KV is not held
        sources, ids = _read_ids(tokenizer, fit_texts, max_tokens)
        if fisher:  # first: its backward pass and the fit's running sums are not held at once (peak memory)
            _say(f"Fisher weights on {min(fisher_texts, len(ids))} texts (the longest step)", t0)
            weights = _fisher(model, ids, sink_tokens, fisher_texts)
        stream = _stream_from_model(model, layout, ids, settings, None if no_rope else layout.uniform_rope)
        kvs = None
    else:
        kvs, sources, ids, prefixes = _kv_from_model(
            model, tokenizer, layout, fit_texts, max_tokens, fisher_texts * fisher
        )
    _say(f"KV of the {len(held_texts)} held-out texts", t0)
    held_kvs, held_sources, held_ids, _ = _kv_from_model(model, tokenizer, layout, held_texts, max_tokens)
    grouped = not layout.spec.uniform
    data = dict(
        model=model,
        layout=layout,
        grouped=grouped,
        kvs=kvs,
        stream=stream,
        held=held_kvs,
        held_ids=held_ids,
        held_sources=held_sources,
        meta={"model": model_name, "model_id": model_id(model), "sources": sources},
        device=device,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
    )
    if fisher:
        if stream is None:  # the Fisher on the extraction's prefix KV (no second prefill of them)
            _say(f"Fisher weights on {min(fisher_texts, len(ids))} texts (the longest step)", t0)
            weights = _fisher(model, ids, sink_tokens, fisher_texts, prefixes)
        data["fisher"] = weights  # None: texts too short
        data["fisher_texts"] = fisher_texts
    return data


def _file_data(kv_files, holdout) -> dict:
    import torch

    kvs, meta = _load_kv_files(kv_files)
    sources = meta.get("sources") or [str(p) for p in kv_files]
    fit, held = split_held_out(list(zip(kvs, sources)), holdout)
    return dict(
        model=None,
        grouped=not isinstance(kvs[0], torch.Tensor),
        kvs=[k for k, _ in fit],
        held=[k for k, _ in held],
        held_sources=[s for _, s in held],
        meta={"model": meta.get("model"), "model_id": meta.get("model_id"), "sources": [s for _, s in fit]},
        file_meta=meta,
    )


def _fit_uniform(data: dict, settings: dict, rope_flags, alpha: float) -> dict:
    from kvcodec.transform import calibrate

    if data.get("layout") is not None:
        rope = None if rope_flags[3] else data["layout"].uniform_rope
    else:
        meta = dict(data["file_meta"], head_dim=str(data["kvs"][0].shape[-1]))
        rope = resolve_rope(meta, *rope_flags)
    info = dict(data["meta"])
    w = None
    if data.get("fisher") is not None:
        from kvcodec.transform.weights import channel_weights

        w = channel_weights(
            data["fisher"],
            rope_style=None if rope is None else rope.style,
            rotary_dim=None if rope is None else rope.rotary_dim,
            alpha=alpha,
        )
        info.update(weights="fisher", weight_alpha=alpha, fisher_texts=data["fisher_texts"])
    if data.get("stream") is not None:
        cal = data["stream"].finish(weights=w, info=info, held_out=data["held"])
    else:
        cal = calibrate(data["kvs"], rope, weights=w, info=info, held_out=data["held"], **settings)
    return {"cal": cal, "fallback": cal.info.get("fallback", []), "weighted": w is not None}


def _fit_grouped(data: dict, settings: dict, rope_flags, alpha: float) -> dict:
    from kvcodec.transform import calibrate

    spec = data["kvs"][0].spec
    if data.get("layout") is not None:
        ropes = [None if rope_flags[3] else data["layout"].group_rope(g) for g in spec.groups]
    else:
        ropes = group_ropes(spec, data["file_meta"], *rope_flags)
    parts, fallback = {}, []
    for gi, g in enumerate(spec.groups):
        starts = {k.starts[gi] for k in [*data["kvs"], *data["held"]]}
        if len(starts) != 1:
            raise ConfigError(f"group {g.name}: the KV files hold it from different positions {sorted(starts)}")
        cal = calibrate(
            [k.tensors[gi] for k in data["kvs"]],
            ropes[gi],
            info=dict(data["meta"], group=g.name),
            held_out=[k.tensors[gi] for k in data["held"]],
            first_position=starts.pop(),
            **settings,
        )
        parts[g.name] = cal
        fallback += [f"{g.name}:{b}" for b in cal.info.get("fallback", [])]
    return {"spec": spec, "parts": parts, "fallback": fallback, "weighted": False}


def report_coder() -> str:
    """The coder the quality report measures the chunks of every point with: the codec's default,
    or zstd where that codes video and no video encoder is installed."""
    from kvcodec.codecs.transform.codec import DEFAULT_CODER, VIDEO_CODERS
    from kvcodec.video.registry import available_backends

    if DEFAULT_CODER in VIDEO_CODERS and not available_backends()["encoders"]:
        return "zstd"
    return DEFAULT_CODER


def _codec_factory(result: dict, coder: str):
    from kvcodec.codecs.grouped import GroupedCodec
    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.transform.kvt import kvt_hash, to_bytes

    if "cal" in result:
        cal = result["cal"]
        digest = kvt_hash(to_bytes(cal))
        return lambda r: TransformCodec(cal, kvt_hash=digest, target_ratio=r, coder=coder)
    digests = {n: kvt_hash(to_bytes(c)) for n, c in result["parts"].items()}
    first = result["spec"].groups[0].name

    def make(r: float):
        codecs = {
            n: TransformCodec(c, kvt_hash=digests[n], target_ratio=r, coder="zstd", fine_tokens=0)
            for n, c in result["parts"].items()
        }
        return GroupedCodec(codecs[first], codecs)

    return make


def _quality(data: dict, result: dict, ratios: list[float], coder: str) -> list:
    from kvcodec.models.quality import measure_kv, measure_model

    if not data["held"]:
        return []
    make = _codec_factory(result, coder)
    if data.get("model") is not None:
        return measure_model(data["model"], data["layout"], data["held_ids"], make, ratios)
    return measure_kv(data["held"], make, ratios)


def _peak_rss_mb() -> float:
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


def _where(data: dict) -> dict:
    """Where --model ran: {"device", "dtype", "peak_gpu_mb" (a GPU: the most this process held)}; {} for KV files."""
    dev = data.get("device")
    if dev is None:
        return {}
    out = {"device": str(dev), "dtype": data["dtype"]}
    if dev.type == "cuda":
        import torch

        out["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(dev) / 2**20)
    return out


def _save(out: Path, data: dict, result: dict, report: dict, seconds: float, where: dict) -> str:
    from kvcodec.transform import save_kvt
    from kvcodec.transform.grouped_kvt import save_grouped_kvt

    cost = {"seconds": round(seconds, 1), "peak_rss_mb": round(_peak_rss_mb()), **where}
    if "cal" in result:
        result["cal"].info.update(quality=report, calibration_cost=cost)
        return save_kvt(result["cal"], out)
    info = dict(data["meta"], quality=report, fallback=result["fallback"], calibration_cost=cost)
    return save_grouped_kvt(result["spec"], result["parts"], out, info)


def _print_report(out: Path, result: dict, report: dict, digest: str, seconds: float, where: dict) -> None:
    if "cal" in result:
        cal = result["cal"]
        sizes = sorted({len(g) for g in cal.groups})
        rope = cal.rope
        what = (
            f"{len(cal.groups)} layer groups of {'/'.join(map(str, sizes))} layers from {cal.info['tokens']} tokens, "
            f"rope {'off' if rope is None else f'theta={rope.theta:g} {rope.style}'}"
        )
    else:
        what = ", ".join(
            f"{name}: {len(c.groups)} groups, rope {'off' if c.rope is None else f'theta={c.rope.theta:g}'}"
            for name, c in result["parts"].items()
        )
    ran = f" on {where['device']} ({where['dtype']})" if where else ""
    gpu = f", peak GPU memory {where['peak_gpu_mb']} MB" if "peak_gpu_mb" in where else ""
    click.echo(
        f"{out}: {what}, {'Fisher-weighted' if result['weighted'] else 'plain MSE'}, sha256 {digest[:16]}, "
        f"{out.stat().st_size / 1e6:.1f} MB, {seconds:.1f} s{ran}, peak RSS {_peak_rss_mb():.0f} MB{gpu}"
    )
    fell = result["fallback"]
    if report["held_out"]:
        click.echo(f"per-channel fallback (held-out check): {', '.join(fell) if fell else 'none'}")
        click.echo(f"held-out quality ({', '.join(report['held_out'])}): {summary(report)}")
        safe = report.get("safe_ratio")
        click.echo(f"safe ratio (no measurable loss): {f'{safe:g}x' if safe else 'none of the measured ratios'}")
    else:
        click.echo(
            "no held-out texts or KV files: no fallback check and no quality report (give three or more, or --holdout)"
        )
