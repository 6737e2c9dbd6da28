"""The --transform MODEL.kvt and --target-ratios options of the benches that measure the transform codec beside
their own methods (`bench accuracy`, `bench ratio`): one lossy method kvcodec-transform-<r> per ratio, the .kvt
checked against every model before any model loads; and the --transform of the benches that store with one
--method (`bench fetch`, `bench interference`)."""

from __future__ import annotations

import math
from pathlib import Path

import click


def kvt_option(command):  # noqa: ANN001, ANN201 - a click command
    """--transform: the .kvt a kvcodec-transform-<ratio> --method codes with (a Path, or None)."""
    return click.option(
        "--transform",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=None,
        help="The MODEL.kvt a kvcodec-transform-<ratio> method codes with (`kvcodec calibrate`).",
    )(command)


def transform_options(command):  # noqa: ANN001, ANN201 - a click command
    """--transform (the .kvt, as `kvt`) and --target-ratios on `command`."""
    command = click.option(
        "--target-ratios",
        default="5,8",
        show_default=True,
        help="With --transform: comma-separated target ratios vs fp16 (each > 1).",
    )(command)
    return click.option(
        "--transform",
        "kvt",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=None,
        help="Also measure the transform codec of this MODEL.kvt (`kvcodec calibrate`): one lossy method "
        "kvcodec-transform-<r> per --target-ratios r.",
    )(command)


def transform_methods(ctx: click.Context, kvt: Path | None, target_ratios: str, models: list[str]) -> list[str]:
    """The kvcodec-transform-<r> methods of --transform and --target-ratios; the .kvt is checked
    against every model here, before any model loads."""
    if kvt is None:
        if ctx.get_parameter_source("target_ratios") != click.core.ParameterSource.DEFAULT:
            raise click.UsageError("--target-ratios needs --transform PATH.kvt", ctx=ctx)
        return []
    methods = transform_method_names(target_ratios)
    check_kvt(kvt, models)
    return methods


def transform_method_names(target_ratios: str) -> list[str]:
    """["kvcodec-transform-5", "kvcodec-transform-8"] of "5,8"; a ratio that is not a number > 1 is refused."""
    from kvbench.methods import TRANSFORM, expand_methods

    try:
        ratios = [float(r) for r in target_ratios.split(",") if r.strip()]
    except ValueError:
        ratios = []
    if not ratios or not all(math.isfinite(r) and r > 1 for r in ratios):
        raise click.BadParameter(
            f"{target_ratios!r}: comma-separated target ratios vs fp16, each a number > 1 (e.g. 5,8)",
            param_hint="--target-ratios",
        )
    if any(float(f"{r:g}") != r for r in ratios):  # a method's name holds its ratio to 6 significant digits
        raise click.BadParameter(
            f"{target_ratios!r}: give each target ratio in at most 6 significant digits", param_hint="--target-ratios"
        )
    return expand_methods([TRANSFORM], ratios)


def check_kvt(kvt: Path, models: list[str]) -> None:
    """Refuse a file that is not a .kvt, a grouped one (this bench codes one KV tensor), and one made
    for another KV shape than one of `models` (from its config); warn of one calibrated on another model."""
    import kvcodec
    from kvcodec.cli.transform_io import warn_if_other_model
    from kvcodec.errors import KVCodecError
    from kvcodec.models.check import inspect_model

    try:
        codec = kvcodec.make_codec("transform", transform=kvt)
    except KVCodecError as e:
        raise click.BadParameter(str(e), param_hint="--transform") from e
    if getattr(codec, "cal", None) is None:
        raise click.BadParameter(f"{kvt} is a grouped .kvt; this bench codes one KV tensor", param_hint="--transform")
    for m in models:
        warn_if_other_model(codec, m, "the model measured")
        spec = inspect_model(m).spec
        try:
            if spec.uniform:
                codec.cal.check_shape(spec.groups[0].shape(1))
        except KVCodecError as e:
            raise click.BadParameter(f"{m}: {e}", param_hint="--transform") from e
