"""`hybridmem models`: the presets a user can name, their families and tiers."""

from __future__ import annotations

import json

import typer


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def models_command(
    as_json: bool = typer.Option(False, "--json", help="One JSON object per preset, a list."),
) -> None:
    """List the shipped model presets: family folder, model_type, kind, parameters, which tiers
    price them."""
    from hybridmem.models.catalog import catalog

    rows = catalog()
    if as_json:
        typer.echo(json.dumps([r.as_dict() for r in rows], indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("preset", "family", "model_type", "kind", "params", "tiers", box=None)
    for r in rows:
        params = "-" if r.params is None else _count(r.params)
        table.add_row(r.name, r.family, r.model_type, r.kind, params, ", ".join(r.tiers))
    Console(width=112).print(table)
    typer.echo("Any other transformers causal-LM / image-text-to-text config.json: "
               "--model path/to/config.json (trace tier).")


def register(app: typer.Typer) -> None:
    app.command("models")(models_command)
