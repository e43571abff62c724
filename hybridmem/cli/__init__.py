"""The `hybridmem` command: registers one module per subcommand and maps bad input to exit 2.

Subcommand modules define `register(app)`; a module whose optional dependencies are missing
is skipped, so `hybridmem predict` works with the base install.
"""

from __future__ import annotations

import sys
from importlib import import_module

import typer

from hybridmem.console import run_app

SUBCOMMANDS: tuple[str, ...] = ("predict", "models", "collect", "train", "evaluate", "importer")

app = typer.Typer(
    name="hybridmem",
    help="Predict the peak GPU memory of a training job before it runs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Predict the peak GPU memory of a training job before it runs."""


def _register_all() -> None:
    for name in SUBCOMMANDS:
        try:
            module = import_module(f"hybridmem.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name and err.name.startswith("hybridmem.cli."):
                continue  # subcommand not built yet
            raise
        module.register(app)


_register_all()


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: one-line errors on stderr, exit 2, no traceback."""
    return run_app(app, argv)


if __name__ == "__main__":
    sys.exit(main())
