"""`python -m hybridmem.harness --sweep ...`: the collect command alone.

For bare GPU machines: it needs neither the other subcommands' dependencies nor an installed
package (`PYTHONPATH=<repo>` is enough). Same options, same one-line errors and exit 2.
"""

import sys

import typer

from hybridmem.harness.command import collect_command
from hybridmem.console import run_app


def main(argv: list[str] | None = None) -> int:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command("collect")(collect_command)  # single command: run without its name
    return run_app(app, argv)


if __name__ == "__main__":
    sys.exit(main())
