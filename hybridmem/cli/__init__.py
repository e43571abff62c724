"""The `hybridmem` command: registers one module per subcommand and maps bad input to exit 2.

Subcommand modules define `register(app)`; a module whose optional dependencies are missing
is skipped, so `hybridmem predict` works with the base install. A command line registers only
the subcommand it names (`wanted`), so options are parsed before anything heavy is imported.
"""

from __future__ import annotations

import sys
from importlib import import_module

import typer

from hybridmem.console import run_app

SUBCOMMANDS: tuple[str, ...] = ("predict", "plan", "models", "gpus", "collect", "train", "evaluate",
                               "importer",
                               "serve", "doctor")

def build_app(names: tuple[str, ...] = SUBCOMMANDS) -> typer.Typer:
    """The `hybridmem` app with the subcommands `names` registered."""
    from hybridmem.cli.coerce import PlainGroup

    out = typer.Typer(
        cls=PlainGroup,
        name="hybridmem",
        help="Predict the peak GPU memory of a training job before it runs.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )

    @out.callback()
    def _root() -> None:
        """Predict the peak GPU memory of a training job before it runs."""

    for name in names:
        try:
            module = import_module(f"hybridmem.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name and err.name.startswith("hybridmem.cli."):
                continue  # subcommand not built yet
            raise
        module.register(out)
    return out


def wanted(argv: list[str]) -> tuple[str, ...]:
    """The subcommands a command line needs registered: the one it names (registering only it
    keeps `hybridmem predict` from importing what the other subcommands' modules import, such
    as pandas), else all of them (the root help lists every subcommand)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return (first,) if first in SUBCOMMANDS else SUBCOMMANDS


def __getattr__(name: str):
    """`hybridmem.cli.app`: every subcommand registered (built on first use)."""
    if name == "app":
        globals()["app"] = built = build_app()
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: one-line errors on stderr, exit 2, no traceback."""
    args = sys.argv[1:] if argv is None else list(argv)
    return run_app(build_app(wanted(args)), args)


if __name__ == "__main__":
    sys.exit(main())
