"""Where benchmark results go and the one writer of result files.

Every benchmark writes its result as `<stem>.json` (the record, with the machine it ran on and the
command that made it) and `<stem>.md` (a human-readable report that starts with that command)
through `write_result`. The command is recorded without the program's path, always in its
`kvcodec bench <name> ...` form, however the benchmark was started (`kvcodec bench`,
`kvcodec-bench`, `python -m kvbench`).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

_TREE_RESULTS = Path(__file__).resolve().parent.parent / "results"
RESULTS_DIR = _TREE_RESULTS if _TREE_RESULTS.is_dir() else Path("benchmarks") / "results"
"""benchmarks/results/ of the source tree this package lives in (an editable install), else
benchmarks/results/ under the current directory."""


def result_path(path: str | os.PathLike | None, default_stem: str, suffix: str = ".json") -> Path:
    """The file a result goes to: `path` when given, else RESULTS_DIR/<default_stem><suffix>."""
    return Path(path) if path else RESULTS_DIR / f"{default_stem}{suffix}"


def command_line(bench: str, argv: Sequence[str] | None = None) -> str:
    """`kvcodec bench <bench> <its arguments>`, read from argv (default sys.argv) after the
    benchmark's own name; everything before it (program path, group options) is left out. Where
    argv does not name the benchmark (called from Python, e.g. a test), the arguments are the
    current click command's parameters."""
    args = list(sys.argv[1:] if argv is None else argv)
    if bench in args:
        args = args[args.index(bench) + 1 :]
    else:
        args = _explicit_options(click.get_current_context(silent=True))
    return " ".join(["kvcodec", "bench", bench, *map(shlex.quote, args)])


def _explicit_options(ctx: click.Context | None) -> list[str]:
    """The options given on the command line of the current click command, as arguments."""
    if ctx is None:
        return []
    args = []
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if not param.opts or ctx.get_parameter_source(param.name) != click.core.ParameterSource.COMMANDLINE:
            continue
        if getattr(param, "is_flag", False):
            args += [param.opts[0]] if value else []
        elif value is not None:
            args += [param.opts[0], str(value)]
    return args


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """What a timing depends on: OS, Python, CPU (model, count, load: the development CPU is
    shared), torch and its thread count, the GPU when there is one."""
    import torch

    m: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        m["load_avg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    if torch.cuda.is_available():
        m["gpu"] = torch.cuda.get_device_name(0)
    m |= kvcodec_switches()
    return m


def kvcodec_switches() -> dict[str, Any]:
    """The KVCODEC_* settings a run had (folders left out) and the restore's host pool size."""
    from kvcodec.codecs.driven import host_threads
    from kvcodec.errors import ConfigError

    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVCODEC_") and not k.endswith("_DIR")}
    try:
        threads: int | str = host_threads()
    except ConfigError as e:
        threads = str(e)
    return {"kvcodec_env": env, "host_threads": threads}


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_json(path: str | os.PathLike, doc: dict[str, Any]) -> Path:
    """Write (or rewrite: benchmarks save partial results as they go) a result's JSON."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=1) + "\n")
    return p


def write_result(path: str | os.PathLike, doc: dict[str, Any], markdown: str | Sequence[str]) -> Path:
    """Write `doc` to path (.json) and `markdown` beside it (.md); returns the JSON path.

    doc gets `machine` and `time` when it has none; it must carry `command` (from command_line),
    which the markdown should show."""
    if "command" not in doc:
        raise ValueError("a result records the command that made it")
    doc.setdefault("machine", machine())
    doc.setdefault("time", utc_now())
    p = write_json(Path(path).with_suffix(".json"), doc)
    text = markdown if isinstance(markdown, str) else "\n".join(markdown)
    p.with_suffix(".md").write_text(text.rstrip("\n") + "\n")
    return p


def check_tag(ctx: Any, param: Any, value: str) -> str:
    """A click callback for a result's file-name --tag: a name, never a path (../x wrote elsewhere)."""
    import click

    if not value or "/" in value or "\\" in value or value.startswith("."):
        raise click.BadParameter(f"{value!r}: a tag is part of a file name (no '/', no leading '.')")
    return value
