"""`hybridmem import`: measurements made elsewhere -> dataset rows: published figures
(`source="published"`) or the folders users' training runs wrote (`--from user`)."""

from __future__ import annotations

import typer

from hybridmem.published.importer import ADAPTERS, DEFAULT_OUT

USER = "user"
"""`--from user`: dataset folders written by `hybridmem.integrations` (`harness/user_run.py`)."""


def import_command(
    files: list[str] = typer.Argument(..., help="JSON-lines file(s) of published records, or "
                                      "with --from user the dataset folders of users' runs."),
    source: str = typer.Option(..., "--from", help="Kind of records: "
                               f"{', '.join(sorted([*ADAPTERS, USER]))}."),
    out: str | None = typer.Option(None, "--out", help="Dataset folder to add the rows to "
                                   f"(default: {DEFAULT_OUT}, with --from user datasets/user)."),
) -> None:
    """Import real GPU measurements made elsewhere as dataset rows (de-duplicated)."""
    if source == USER:
        from hybridmem.harness.user_run import DEFAULT_OUT as USER_OUT, merge_folders

        r = merge_folders(files, out or USER_OUT)
        typer.echo(f"user: {r.rows} rows in {r.folders} folders; added {r.added} rows to "
                   f"{out or USER_OUT}; already present: {r.already_present}")
        return
    from hybridmem.published.importer import import_file

    for file in files:
        r = import_file(source, file, out or DEFAULT_OUT)
        typer.echo(f"{r.source}: {r.records} records in {r.path}; added {r.added} rows to {r.out} "
                   f"({r.outcomes.get('ok', 0)} ok, {r.outcomes.get('excluded', 0)} excluded); "
                   f"already present: {r.already_present}")
        for reason, n in sorted(r.excluded.items(), key=lambda kv: (-kv[1], kv[0])):
            typer.echo(f"excluded {n}: {reason}")


def register(app: typer.Typer) -> None:
    app.command("import")(import_command)
