"""The benchmarks' click group: each benchmark is a module with a click `command`."""

from __future__ import annotations

import importlib
import logging

import click

from kvcodec.cli.program import run_program

BENCH_MODULES = (
    "kvbench.ratio",
    "kvbench.encode",
    "kvbench.decode",
    "kvbench.fetch",
    "kvbench.ttft",
    "kvbench.ttft_engine",
    "kvbench.interference",
    "kvbench.accuracy",
    "kvbench.plot",
    "kvbench.baselines.measure",
)


@click.group("bench", context_settings={"help_option_names": ["-h", "--help"]})
def group() -> None:
    """Run a benchmark; results go to benchmarks/results/ as JSON and a markdown table."""


for _name in BENCH_MODULES:
    group.add_command(importlib.import_module(_name).command)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    run_program(group, error_prefix="kvbench: error: ", error_code=2)
