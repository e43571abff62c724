"""`python -m hybridmem.harness --sweep ...`: the collect command alone.

For bare GPU machines: it needs neither the other subcommands' dependencies nor an installed
package (`PYTHONPATH=<repo>` is enough). Same options, same one-line errors and exit 2.
"""

import sys

import typer

from hybridmem.harness.command import collect_command
from hybridmem.errors import SpecError


def main(argv: list[str] | None = None) -> int:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command("collect")(collect_command)  # single command: run without its name
    try:
        app(args=sys.argv[1:] if argv is None else argv, standalone_mode=False)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except typer.Exit as err:
        return err.exit_code
    except Exception as err:  # click usage errors carry their own message and exit code
        if hasattr(err, "show") and isinstance(getattr(err, "exit_code", None), int):
            err.show()
            return err.exit_code
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
