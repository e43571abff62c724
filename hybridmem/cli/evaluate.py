"""`hybridmem evaluate`: held-out error table of analytic / trace / hybrid, or registry A vs B."""

from __future__ import annotations

from typing import Optional

import typer

METRIC_COLUMNS: tuple[tuple[str, str], ...] = (
    ("n", "rows"), ("mape", "MAPE%"), ("median_ape", "medAPE%"), ("p95_ape", "P95APE%"),
    ("under_share", "under"), ("verdict_acc", "verdict"), ("bound_coverage", "bound"),
    ("oom_caught", "OOM"),
)
CAPTION = ("under: share of under-predictions; verdict: fits/does-not-fit accuracy at GPU = "
           "measured x {0.9, 0.95, 1.05, 1.1}; bound: share measured <= P95 upper bound; "
           "OOM: share of real OOM rows predicted not to fit")


def metrics_table(table: dict[str, dict[str, float]], title: str):
    """A rich Table: one row per method, the metrics of `hybridmem.learned.metrics`."""
    from rich.table import Table

    columns = [(k, h) for k, h in METRIC_COLUMNS if any(k in m for m in table.values())]
    out = Table(title=title, caption=CAPTION)
    out.add_column("method", no_wrap=True)
    for _, header in columns:
        out.add_column(header, justify="right")
    for method, m in table.items():
        cells = []
        for key, _ in columns:
            v = m.get(key)
            cells.append("-" if v is None else f"{int(v)}" if key == "n"
                         else f"{v:.1%}" if key in ("under_share", "verdict_acc", "bound_coverage", "oom_caught")
                         else f"{v:.2f}")
        out.add_row(method, *cells)
    return out


def print_notes(notes: list[str]) -> None:
    for note in notes:
        typer.echo(f"note: {note}")


def group_tables(table):
    """One rich Table per figure: tier x length kind x group rows, signed/absolute error
    columns; upper-bound rows (priced at their length cap) are never pooled with exact ones."""
    from rich.table import Table

    from hybridmem.learned.accuracy import COLUMNS, FIGURE_NAMES, cell, length_label

    out = []
    for figure, part in table.groupby("figure", sort=False):
        t = Table(title=f"{FIGURE_NAMES.get(figure, figure)}: error vs real GPUs",
                  caption="error = (predicted - measured) / measured; under-predicted: share "
                          "below the measurement; hybrid is held out (grouped CV) and answers "
                          "as predict does (the residual only where its evidence trusts it)")
        t.add_column("tier", no_wrap=True)
        t.add_column("group", no_wrap=True)
        t.add_column("lengths", no_wrap=True)
        for key, header in COLUMNS:
            unit = "" if key in ("n", "within_3pct", "under_share") else " %"
            t.add_column(header.replace(" abs", " |err|") + unit, justify="right")
        for rec in part.to_dict("records"):
            t.add_row(rec["tier"], rec["group"], length_label(rec.get("lengths")),
                      *(cell(k, rec[k], "") for k, _ in COLUMNS))
        out.append(t)
    return out


HOLDOUT_LEGEND = ("MAPE, P95 |err|: absolute % error; under: share of under-predictions; bound: "
                  "share measured <= the stated upper bound (rows with one); residual: the "
                  "split's trees on every row; hybrid: what predict answers (the residual where "
                  "its own held-out evidence trusts it for the job group, else analytic)")


def holdout_tables(result):
    """One rich Table per held-out split: figure x tier x group rows with `holdout.METRICS`."""
    from rich.table import Table

    out = []
    for s in result.splits:
        part = result.table[result.table["split"] == s.name]
        if part.empty:
            continue
        t = Table(title=f"held out: {s.name} (residual trained on {s.trained_on})")
        for name in ("figure", "tier", "group", "rows", "MAPE %", "P95 |err| %", "under",
                     "bound", "rows w/ bound"):
            t.add_column(name, justify="left" if name in ("figure", "tier", "group") else "right",
                         no_wrap=True)
        for rec in part.to_dict("records"):
            bound = "-" if not rec["n_bound"] else f"{rec['bound_coverage']:.0%}"
            t.add_row(rec["figure"], rec["tier"], rec["group"], f"{int(rec['n'])}",
                      f"{rec['mape']:.1f}", f"{rec['p95_ape']:.1f}", f"{rec['under_share']:.0%}",
                      bound, f"{int(rec['n_bound'])}")
        out.append(t)
    return out


def use_tracking_dir(folder: str) -> None:
    """Send this process's MLflow runs to a SQLite store in `folder` (`hybridmem.tracking`)."""
    import os
    from pathlib import Path

    os.environ["HYBRIDMEM_MLFLOW_URI"] = f"sqlite:///{(Path(folder) / 'mlflow.db').resolve()}"


def evaluate_command(
    data: str = typer.Option(..., "--data", help="Dataset (parquet file or folder) from `hybridmem collect` or `hybridmem import`."),
    model: Optional[list[str]] = typer.Option(None, "--model", help="Registry entry (folder) to score; repeat to compare A and B."),
    target: Optional[str] = typer.Option(None, "--target", help="device or reserved peak (default: device if measured, else reserved)."),
    folds: int = typer.Option(5, "--folds", help="GroupKFold splits (by model shape, or by configuration when all rows share one model) without --model."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Save the predicted-vs-measured plot to FILE (PNG/SVG/PDF)."),
    with_trace: bool = typer.Option(False, "--trace-features", help="Cross-validate with the trace-peak features (as train --trace-features)."),
    tiers: str = typer.Option("analytic,trace", "--tiers", help="Tiers priced per row for the by-group table (trace answers are cached; '' = none)."),
    errors_csv: Optional[str] = typer.Option(None, "--errors-csv", help="Write every row's signed error per tier and figure to FILE."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Re-price every row with the trace tier instead of reading the cache."),
    holdout: Optional[str] = typer.Option(None, "--holdout", help="torch: hold out each later torch version, training on the older ones only; source: hold out each source of rows, training on the others. Every tier per job group; one MLflow run per held-out split."),
    tracking: Optional[str] = typer.Option(None, "--tracking", help="Folder of the MLflow store for this run (default experiments/mlruns or $HYBRIDMEM_MLFLOW_URI)."),
    track: bool = typer.Option(True, "--track/--no-track", help="Log --holdout splits to MLflow."),
) -> None:
    """Errors against measured rows: analytic vs trace vs hybrid by group and figure, or model A vs B."""
    from rich.console import Console

    from hybridmem.errors import SpecError
    from hybridmem.learned.compare import compare, default_target, tier_accuracy

    if target is not None and target not in ("device", "reserved"):
        raise SpecError("target", target, ("device", "reserved"))
    console = Console()
    if tracking:
        use_tracking_dir(tracking)
    if holdout is not None:
        from hybridmem.learned.holdout import holdout as run_holdout

        if model:
            raise SpecError("holdout", holdout, reason="trains its own residual per split; "
                            "give --model without --holdout")
        names = tuple(t.strip() for t in tiers.split(",") if t.strip())

        def priced(i: int, n: int, name: str) -> None:
            typer.echo(f"  trace: pricing spec {i}/{n} ({name})", err=True)

        result = run_holdout(data, holdout, tiers=names, n_splits=folds, use_cache=not no_cache,
                             track=track, progress=priced)
        for t in holdout_tables(result):
            console.print(t)
        typer.echo(HOLDOUT_LEGEND)
        print_notes(result.notes)
        if result.run_ids:
            typer.echo(f"MLflow runs (experiment holdout): {', '.join(result.run_ids)}")
        if errors_csv:
            result.errors.to_csv(errors_csv, index=False)
            typer.echo(f"errors: {errors_csv}")
        return
    target = target or default_target(data)
    if model:
        result = compare(data, models=model, target=target, n_splits=folds, plot=plot,
                         with_trace=with_trace)
        console.print(metrics_table(result.table, f"{target} peak, held-out rows"))
        print_notes(result.notes)
        if plot:
            typer.echo(f"plot: {plot}")
        return
    result = compare(data, target=target, n_splits=folds, plot=plot, with_trace=with_trace)
    console.print(metrics_table(result.table, f"{target} peak, held-out groups"))
    print_notes(result.notes)
    names = tuple(t.strip() for t in tiers.split(",") if t.strip())

    def progress(tier: str, i: int, n: int, name: str) -> None:
        typer.echo(f"  {tier}: pricing spec {i}/{n} ({name})", err=True)

    acc = tier_accuracy(data, tiers=names, n_splits=folds, use_cache=not no_cache,
                        progress=progress)
    for t in group_tables(acc.table):
        console.print(t)
    print_notes(acc.notes)
    if errors_csv:
        acc.errors.to_csv(errors_csv, index=False)
        typer.echo(f"errors: {errors_csv}")
    if plot:
        typer.echo(f"plot: {plot}")


def register(app: typer.Typer) -> None:
    app.command("evaluate")(evaluate_command)
