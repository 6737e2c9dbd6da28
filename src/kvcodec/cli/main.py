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
# what `kvcodec --help` lists for each, without importing the modules (calibrate and bench import torch:
# seconds); the commands' own short help, which tests/test_cli_audit.py holds these to
SUMMARIES = {
    "bench": "Run a benchmark; results go to benchmarks/results/ as JSON and a markdown table.",
    "calibrate": "Learn a transform (a mean and a PCA basis per group of layers, for K and V) from KV_FILES"
    " (written by `kvcodec extract`) or from --model on --texts (by default a fixed set of essays, Python sources"
    " and their documentation, none of them an evaluation text: see --texts); write it to OUT.kvt.",
    "decode": "Decode SRC.kvc into DST.safetensors (one tensor named `kv`).",
    "demo": "Store a document's KV, then reuse it over an emulated link: TTFT and identical answers.",
    "encode": "Encode SRC.safetensors (a tensor named `kv`, shape layers x 2 x tokens x kv_heads x head_dim)"
    " into DST.kvc.",
    "extract": "Prefill MODEL on a text and save its KV to OUT.safetensors.",
    "ingest": "Prefill each document of DOCS with MODEL and store its KV in the store.",
    "inspect": "Show what a kvcodec file (or one chunk blob, as a store holds it) holds: format and version,"
    " codec, KV shape and dtype, tokens and chunks, sizes and ratio vs fp16, and what its format adds (an HEVC"
    " .kvc file's quantization, streams and layouts; a transform file's calibration and settings; a grouped"
    " file's groups).",
    "serve": "Serve a model over an OpenAI-compatible API with remote KV prefix reuse.",
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

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The listing from SUMMARIES: no subcommand's module is imported to print it."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))
        rows = [(n, click.Command(n, help=self._summary(ctx, n)).get_short_help_str(limit)) for n in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def _summary(self, ctx: click.Context, name: str) -> str:
        if name in SUMMARIES and name not in self.commands:
            return SUMMARIES[name]
        cmd = self.get_command(ctx, name)
        return cmd.get_short_help_str(limit=10**6) if cmd is not None else ""

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
