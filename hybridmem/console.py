"""Running a typer app the way every hybridmem entry point does: bad input is one line on
stderr and exit code 2, never a traceback."""

from __future__ import annotations

import sys

import typer

from hybridmem.errors import SpecError


def run_app(app: typer.Typer, argv: list[str] | None = None) -> int:
    """Run `app` on `argv` (default: sys.argv[1:]) and return the process exit code."""
    try:
        app(args=sys.argv[1:] if argv is None else argv, standalone_mode=False)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except typer.Exit as err:
        return err.exit_code
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 130
    except Exception as err:
        # click usage errors (typer vendors click, so match by shape) carry their own message
        # and exit code (2 for usage errors): the error on the first line, as every other
        # error's (click's own `show` puts two usage lines before it), then where help is
        if hasattr(err, "show") and isinstance(getattr(err, "exit_code", None), int):
            message = err.format_message() if hasattr(err, "format_message") else str(err)
            print(f"error: {message}", file=sys.stderr)
            ctx = getattr(err, "ctx", None)
            if ctx is not None:
                print(f"Try '{ctx.command_path} --help' for help.", file=sys.stderr)
            return err.exit_code
        raise
    return 0
