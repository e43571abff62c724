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


def evaluate_command(
    data: str = typer.Option(..., "--data", help="Dataset (parquet file or folder) from `hybridmem collect`."),
    model: Optional[list[str]] = typer.Option(None, "--model", help="Registry entry (folder) to score; repeat to compare A and B."),
    target: str = typer.Option("device", "--target", help="device or reserved peak."),
    folds: int = typer.Option(5, "--folds", help="GroupKFold splits (by model shape) without --model."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Save the predicted-vs-measured plot to FILE (PNG/SVG/PDF)."),
    with_trace: bool = typer.Option(False, "--trace-features", help="Cross-validate with the trace-peak features (as train --trace-features)."),
) -> None:
    """Errors on held-out model shapes: analytic vs trace vs hybrid, or model A vs model B."""
    from rich.console import Console

    from hybridmem.learned.compare import compare

    result = compare(data, models=model or (), target=target, n_splits=folds, plot=plot,
                     with_trace=with_trace)
    Console().print(metrics_table(result.table, f"{target} peak, held-out model shapes"))
    print_notes(result.notes)
    if plot:
        typer.echo(f"plot: {plot}")


def register(app: typer.Typer) -> None:
    app.command("evaluate")(evaluate_command)
