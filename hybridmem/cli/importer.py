"""`hybridmem import`: published GPU measurements -> dataset rows (`source="published"`)."""

from __future__ import annotations

import typer

from hybridmem.published.importer import ADAPTERS, DEFAULT_OUT


def import_command(
    file: str = typer.Argument(..., help="JSON-lines file of published records."),
    source: str = typer.Option(..., "--from", help=f"Kind of records: {', '.join(sorted(ADAPTERS))}."),
    out: str = typer.Option(str(DEFAULT_OUT), "--out", help="Dataset folder to add the rows to."),
) -> None:
    """Import published measurements (someone else's real GPU runs) as dataset rows."""
    from hybridmem.published.importer import import_file

    r = import_file(source, file, out)
    typer.echo(f"{r.source}: {r.records} records in {r.path}; added {r.added} rows to {r.out} "
               f"({r.outcomes.get('ok', 0)} ok, {r.outcomes.get('excluded', 0)} excluded); "
               f"already present: {r.already_present}")
    for reason, n in sorted(r.excluded.items(), key=lambda kv: (-kv[1], kv[0])):
        typer.echo(f"excluded {n}: {reason}")


def register(app: typer.Typer) -> None:
    app.command("import")(import_command)
