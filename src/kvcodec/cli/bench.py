"""`kvcodec bench <name>`: benchmarks; each one a module of kvcodec.bench with a click `command`."""

from __future__ import annotations

import importlib

import click

BENCH_MODULES = (
    "kvcodec.bench.ratio",
    "kvcodec.bench.decode",
    "kvcodec.bench.fetch",
    "kvcodec.bench.ttft",
    "kvcodec.bench.interference",
    "kvcodec.bench.accuracy",
    "kvcodec.bench.plot",
    "kvcodec.baselines.measure",
)


@click.group("bench")
def command() -> None:
    """Run a benchmark; results go to benchmarks/results/ as JSON and a markdown table."""


for _name in BENCH_MODULES:
    try:
        _module = importlib.import_module(_name)
    except ModuleNotFoundError as _e:
        if _e.name != _name:
            raise
        continue
    command.add_command(_module.command)
