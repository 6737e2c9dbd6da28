"""Entry point of the `kvcodec` command: a click group that gathers the subcommands by name.

Each module listed in SUBCOMMAND_MODULES defines `command` (a click command or group). Benchmarks
live under `kvcodec bench`, whose own modules are listed in kvcodec.cli.bench. Errors end in one
line, never a traceback: bad options are click usage errors (exit code 2); a KVCodecError or an
OS error (a file that cannot be read or written) prints `error: ...` (exit code 1).
"""

from __future__ import annotations

import importlib
import logging

import click

from kvcodec.cli.program import run_program
from kvcodec.errors import KVCodecError

SUBCOMMAND_MODULES = (
    "kvcodec.cli.codec_cmds",  # encode, decode, inspect
    "kvcodec.cli.extract",  # extract
    "kvcodec.cli.calibrate",  # calibrate
    "kvcodec.cli.demo",  # demo
    "kvcodec.cli.bench",  # bench <name>
    "kvcodec.cli.serve",  # serve
    "kvcodec.cli.ingest",  # ingest
)


class CommandError(click.ClickException):
    """A failure of the work itself (not of the command line): `error: ...`, exit code 1."""

    exit_code = 1

    def show(self, file=None) -> None:  # noqa: ANN001
        click.echo(f"error: {self.format_message()}", err=True, file=file)


class Group(click.Group):
    """The `kvcodec` group: turns KVCodecError and OSError from any subcommand into CommandError."""

    def invoke(self, ctx: click.Context):  # noqa: ANN201
        try:
            return super().invoke(ctx)
        except KVCodecError as e:
            raise CommandError(str(e)) from None
        except OSError as e:
            raise CommandError(f"{e.strerror or e}: {e.filename}" if e.filename else str(e)) from None


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """kvcodec: remote KV-cache reuse; KV caches quantized or transform-coded, then zstd or HEVC video (NVDEC)."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def _register() -> None:
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue  # subcommand not built yet
            raise
        cmds = getattr(module, "commands", None) or [module.command]
        for cmd in cmds:
            cli.add_command(cmd)


_register()


def main() -> None:
    # a KVCodecError raised outside a subcommand's invocation ends as a CommandError would
    run_program(cli, error_prefix="error: ", error_code=CommandError.exit_code)


if __name__ == "__main__":
    main()
