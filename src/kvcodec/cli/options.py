"""Option parsers shared by the `kvcodec` commands: each turns a bad value into click's usage
error (one line naming the option, exit code 2) before any work starts."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click


def parse_resolutions(text: str | None, param: str = "--resolutions") -> tuple[tuple[int, int], ...] | None:
    """ "256x256,512x512" -> ((256, 256), (512, 512)) of frame sizes NVDEC decodes
    (config.video_frame_sizes); None for an empty value."""
    if not text:
        return None
    from kvcodec.config import resolution_pairs, video_frame_sizes
    from kvcodec.errors import ConfigError

    for part in text.split(","):
        try:
            ((_w, _h),) = resolution_pairs(part)
        except (ConfigError, ValueError):  # not WxH, or an empty part (no pair)
            raise click.BadParameter(f"{part!r}: expected WIDTHxHEIGHT, e.g. 512x512", param_hint=param) from None
    try:
        return video_frame_sizes(text, "resolution")
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint=param) from None


def parse_layer_bits(text: str | None) -> tuple[int, ...] | None:
    """ "8,6,4" -> (8, 6, 4); None for an empty value."""
    if not text:
        return None
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: expected comma-separated integers, e.g. 8,8,6", param_hint="--layer-bits"
        ) from None


def parse_deadline(ctx: click.Context | None, param: Any, value: str | float | None) -> float | str | None:
    """--fetch-deadline: "auto", "none" or a positive number of seconds."""
    if value is None or str(value).lower() == "auto":
        return "auto"
    if str(value).lower() == "none":
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected auto, none or seconds > 0") from None
    if not seconds > 0:
        raise click.BadParameter(f"{value!r}: a deadline must be > 0 seconds (or none)")
    return seconds


class FiniteRange(click.FloatRange):
    """click.FloatRange without nan and inf, which FloatRange lets through (a nan link rate hung the demo)."""

    name = "finite float range"

    def convert(self, value: Any, param: Any, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def check_device(ctx: click.Context | None, param: Any, value: str | None) -> str | None:
    """A torch device name this machine has: cpu, cuda, cuda:N."""
    if value is None:
        return None
    import torch

    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError):
        raise click.BadParameter(f"{value!r} is not a device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise click.BadParameter(f"{value!r}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise click.BadParameter(f"{value!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise click.BadParameter(f"{value!r}: only cpu and cuda devices are supported")
    return value


def device_option(default: str | None = "cpu", help: str = "cpu, cuda, cuda:1 ...") -> Callable:
    return click.option("--device", default=default, show_default=default is not None, callback=check_device, help=help)


RUN_DTYPES = ("float32", "bfloat16", "float16")


def dtype_option(help: str) -> Callable:
    """--dtype: the dtype a model runs in (a name of RUN_DTYPES; None: kvcodec.models.run_dtype's rule)."""
    return click.option("--dtype", type=click.Choice(RUN_DTYPES), default=None, help=help)


def torch_dtype(name: str | None):  # noqa: ANN201 - a torch.dtype or None
    """The torch dtype a --dtype value names (None stays None)."""
    import torch

    return getattr(torch, name) if name else None


def count_option(*decls: str, help: str) -> Callable:
    """An optional count: an integer >= 1, or None where it is not given (the command's default)."""
    return click.option(*decls, default=None, type=click.IntRange(min=1), help=help)


def encode_in_option(name: str, help: str) -> Callable:
    """Where stored KV is encoded: worker processes (default) or threads of this process; the
    values of kvcodec.engine.storer.ENCODE_IN (not imported here: it loads the engine)."""
    return click.option(
        name, type=click.Choice(["processes", "threads"]), default="processes", show_default=True, help=help
    )


def check_output_path(ctx: click.Context | None, param: Any, value: Path | None) -> Path | None:
    """An output file whose directory exists and takes new files; where it exists, a regular file
    (outputs are written beside it and renamed over it, which would replace a device such as
    /dev/null, or a FIFO)."""
    value = check_report_path(ctx, param, value)
    if value is not None and value.exists() and not value.is_file():
        raise click.BadParameter(f"{str(value)!r} exists and is not a regular file")
    if value is not None:
        _check_takes_files(value.parent if str(value.parent) else Path("."))
    return value


def _check_takes_files(folder: Path) -> None:
    """A file made and removed in `folder`, before the work whose result would be written there
    (a read-only or full file system failed only at the end, the result lost)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise click.BadParameter(f"cannot write in {str(folder)!r}: {e.strerror or e}") from None


def check_distinct(output: Path | None, hint: str, **inputs: Path | None) -> None:
    """`output` (named by `hint`) is none of `inputs` (option name -> path): written over, an input
    would be gone, and with it every file it is needed to read (a .kvt, say)."""
    if output is None or not output.exists():
        return
    for name, path in inputs.items():
        if path is not None and path.exists() and output.samefile(path):
            raise click.BadParameter(f"{str(output)!r} is {name} itself: name another file", param_hint=hint)


def check_report_path(ctx: click.Context | None, param: Any, value: Path | None) -> Path | None:
    """A file written in place (a report: /dev/stdout will do) whose directory exists, checked
    before the work so that its result is not lost at the end."""
    if value is None:
        return None
    parent = value.parent if str(value.parent) else Path(".")
    if not parent.is_dir():
        raise click.BadParameter(f"directory {str(parent)!r} does not exist")
    if value.is_dir():
        raise click.BadParameter(f"{str(value)!r} is a directory")
    return value


def parse_codec_options(ctx: click.Context | None, param: Any, values: tuple[str, ...]) -> dict[str, Any]:
    """--codec-option key=value (repeated) -> {key: value}: a value that reads as a Python literal
    (8, 2.5, true/false, none, "text", (512, 512)) is that literal, anything else is its text."""
    out: dict[str, Any] = {}
    for item in values or ():
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key.isidentifier():
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE, e.g. quant=int4")
        if key in out:
            raise click.BadParameter(f"{key!r} is given twice")
        out[key] = _literal(text.strip())
    return out


_WORDS = {"true": True, "false": False, "none": None}


def _literal(text: str) -> Any:
    import ast

    if text.lower() in _WORDS:
        return _WORDS[text.lower()]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text
