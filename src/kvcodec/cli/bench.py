"""`kvcodec bench <name>`: the benchmarks of the separate `kvbench` package (benchmarks/ in the
source tree), when it is installed; otherwise a command that says how to install it."""

from __future__ import annotations

import click

INSTALL_HINT = "the benchmarks are not installed; from a kvcodec checkout run: pip install -e benchmarks"


def _missing() -> click.Command:
    @click.command("bench", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def bench() -> None:
        """Benchmarks (needs the kvbench package: pip install -e benchmarks)."""
        raise click.ClickException(INSTALL_HINT)

    return bench


try:
    from kvbench.cli import group as command
except ModuleNotFoundError as e:
    if (e.name or "").partition(".")[0] != "kvbench":
        raise
    command = _missing()
