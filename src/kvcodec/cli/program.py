"""Running a click group as a program (`kvcodec`, `kvbench`): every failure ends in one line on
stderr, never a traceback."""

from __future__ import annotations

import sys

import click

from kvcodec.errors import KVCodecError


def run_program(group: click.Group, error_prefix: str, error_code: int) -> None:
    """Run `group` on the command line. Ctrl-C exits with code 130; a click error prints its
    message and exits with its code; a KVCodecError that reaches here prints `error_prefix` and
    its message and exits with `error_code`. A command's own exit code (click's Exit, which click
    returns instead of raising outside standalone mode) is the program's."""
    try:
        code = group(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KVCodecError as e:
        click.echo(f"{error_prefix}{e}", err=True)
        sys.exit(error_code)
    if isinstance(code, int) and not isinstance(code, bool) and code:
        sys.exit(code)
