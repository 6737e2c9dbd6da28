"""Entry point of the `kvcodec` command: a click group that gathers the subcommands by name.

Each module named in SUBCOMMANDS defines `command` (a click command or group), imported when that
subcommand is asked for. Benchmarks live under `kvcodec bench`, whose own modules are listed in
kvcodec.cli.bench. Errors end in one line, never a traceback: bad options are click usage errors
(exit code 2); a KVCodecError or an OS error (a file that cannot be read or written) prints
`error: ...` (exit code 1).
"""

from __future__ import annotations

import importlib
import logging

import click

from kvcodec.cli.program import run_program
from kvcodec.errors import KVCodecError

SUBCOMMANDS = {  # name -> the module that defines it (as `command`, or among its `commands`)
    "encode": "kvcodec.cli.codec_cmds",
    "decode": "kvcodec.cli.codec_cmds",
    "inspect": "kvcodec.cli.codec_cmds",
    "extract": "kvcodec.cli.extract",
    "calibrate": "kvcodec.cli.calibrate",
    "demo": "kvcodec.cli.demo",
    "bench": "kvcodec.cli.bench",
    "serve": "kvcodec.cli.serve",
    "ingest": "kvcodec.cli.ingest",
}


class CommandError(click.ClickException):
    """A failure of the work itself (not of the command line): `error: ...`, exit code 1."""

    exit_code = 1

    def show(self, file=None) -> None:  # noqa: ANN001
        click.echo(f"error: {self.format_message()}", err=True, file=file)


class Group(click.Group):
    """The `kvcodec` group: imports a subcommand's module when that subcommand is asked for (some
    import torch: a usage error of another stays fast), and turns KVCodecError and OSError from any
    subcommand into CommandError."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*SUBCOMMANDS, *self.commands})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.commands and name in SUBCOMMANDS:
            module = importlib.import_module(SUBCOMMANDS[name])
            for cmd in getattr(module, "commands", None) or [module.command]:
                self.add_command(cmd)
        return self.commands.get(name)

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


def main() -> None:
    # a KVCodecError raised outside a subcommand's invocation ends as a CommandError would
    run_program(cli, error_prefix="error: ", error_code=CommandError.exit_code)


if __name__ == "__main__":
    main()
