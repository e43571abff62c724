"""`hybridmem train`: fit the residual model on a dataset and write it to the registry."""

from __future__ import annotations

from typing import Optional

import typer


def train_command(
    data: str = typer.Option(..., "--data", help="Dataset (parquet file or folder) from `hybridmem collect`."),
    out: str = typer.Option(..., "--out", help="Registry folder to write, e.g. models/h100-torch2.13."),
    target: str = typer.Option("both", "--target", help="device, reserved or both."),
    folds: int = typer.Option(5, "--folds", help="GroupKFold splits (by model shape, or by configuration when every row has one model) for the held-out metrics."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out folder."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Also save the predicted-vs-measured plot to FILE."),
    track: bool = typer.Option(True, "--track/--no-track", help="Log the run to MLflow (experiments/mlruns)."),
    with_trace: bool = typer.Option(False, "--trace-features", help="Also learn from the dataset's trace rows of the same spec (predict then runs the trace tier)."),
) -> None:
    """Train the LightGBM residual on measured rows; held-out metrics, MLflow run, registry entry."""
    from rich.console import Console

    from hybridmem.cli.evaluate import metrics_table, print_notes
    from hybridmem.learned.train import train
    from hybridmem.learned.trust import describe

    result = train(data, out, force=force, target=target, n_splits=folds, plot=plot, track=track,
                   with_trace=with_trace)
    kinds = result.metadata.get("group_kinds") or {}
    for name, ev in result.evaluations.items():
        kind = kinds.get(name, result.metadata.get("group_kind", "model shape"))
        Console().print(metrics_table(ev.table, f"{name} peak, held-out {kind}s (CV)"))
    for name, trusted in (result.metadata.get("trust") or {}).items():
        for group, dec in trusted.items():
            typer.echo(f"trust: {describe(dec, name, group)}")
    print_notes(result.notes)
    meta = result.metadata
    typer.echo(f"model: {result.path} ({meta['dataset']['rows_used']} rows, sources "
               f"{', '.join(meta['sources'])}, calibrated_to_gpu={str(meta['calibrated_to_gpu']).lower()}"
               + (f", MLflow run {meta['mlflow_run_id']}" if meta.get("mlflow_run_id") else "") + ")")


def register(app: typer.Typer) -> None:
    app.command("train")(train_command)
