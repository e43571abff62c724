"""The `collect` command: options -> `hybridmem.harness.collect` -> progress bar and summary.

It lives in the harness (not in `hybridmem.cli`) so that `python -m hybridmem.harness` runs it
on a bare GPU machine without importing the other subcommands.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Optional

import typer

MAX_TABLE_ROWS = 60


def _ranks(row) -> str:
    return "1" if row["strategy"] == "none" else f"{row['world_size']} {row['strategy']}"


def _summary(report) -> None:
    from rich.console import Console
    from rich.table import Table

    from hybridmem.report import gib

    console = Console(width=None if sys.stdout.isatty() else 160)
    rows = report.rows
    table = Table(title=f"{report.sweep.name}: {len(rows)} configs via {report.source}")
    for col in ("model", "mb", "seq", "img", "precision", "optimizer", "train", "ckpt", "attn",
                "ranks", "outcome", "alloc GiB", "device GiB", "step s"):
        table.add_column(col, justify="right" if col[0].isdigit() or "GiB" in col else "left")
    for r in rows[:MAX_TABLE_ROWS]:
        table.add_row(r["model_name"], str(r["micro_batch"]), str(r["seq_len"]),
                      str(r["images_per_sample"]), r["precision"], r["optimizer"],
                      r["train"] + (f" r{r['lora_r']}" if r["lora_r"] else ""),
                      "yes" if r["grad_ckpt"] else "no", r["attn"], _ranks(r), r["outcome"],
                      gib(r["peak_allocated_bytes"]), gib(r["peak_device_bytes"]),
                      "-" if r["step_seconds"] is None else f"{r['step_seconds']:.2f}")
    if rows:
        console.print(table)
    if len(rows) > MAX_TABLE_ROWS:
        console.print(f"... {len(rows) - MAX_TABLE_ROWS} more rows in {report.out}")
    counts = ", ".join(f"{k} {v}" for k, v in sorted(report.counts.items())) or "none"
    console.print(f"outcomes: {counts}; skipped (already measured): {report.skipped}; "
                  f"planned: {report.planned}; {report.wall_seconds:.0f} s -> {report.out}")
    if report.too_many_ranks:
        console.print(f"not run: {report.too_many_ranks} config(s) need more GPUs than this "
                      "machine has (world_size)")
    if report.nodes:
        console.print("rows per node: " + ", ".join(f"{h} {n}" for h, n in
                                                   sorted(report.nodes.items())))
    if report.stopped_by_budget:
        console.print("stopped by the time budget; run again with --resume to continue")
    for reason, n in sorted(report.sweep.dropped.items()):
        console.print(f"dropped {n} impossible combination(s): {reason}")
    for r in rows:
        if r["outcome"] == "error":
            console.print(f"[red]error[/red] {r['model_name']} {r['spec_hash'][:12]}: {r['error']}")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def collect_command(
    sweep: Path = typer.Option(..., "--sweep", help="Sweep TOML file (see datasets/sweeps/README.md)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Dataset folder (default datasets/cuda or datasets/trace)."),
    backend: str = typer.Option("cuda", "--backend", help="cuda (measure on this GPU) or trace (CPU prediction tier)."),
    resume: bool = typer.Option(False, "--resume", help="Skip specs already in the dataset for this environment."),
    max_minutes: Optional[float] = typer.Option(None, "--max-minutes", help="Start no config after this many minutes."),
    record_history: bool = typer.Option(False, "--record-history", help="Save the allocator's memory history per config (cuda)."),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="ADDRESS|auto|local", help="Run each config as a task on a Ray cluster (the ray extra; datasets/sweeps/README.md)."),
) -> None:
    """Measure (or predict) every config of a sweep; one dataset row per config."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hybridmem.harness import collect

    if ray is not None:
        from functools import partial

        from hybridmem.harness.fleet import collect_ray

        collect = partial(collect_ray, address=ray)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), transient=False)
    task = {}

    def on_start(report) -> None:
        progress.start()
        task["id"] = progress.add_task(f"{report.sweep.name} ({report.source})",
                                       total=report.planned - report.skipped - report.too_many_ranks)

    def on_item(item) -> None:
        spec = item.spec
        ps = spec.parallel
        ranks = "" if ps.strategy == "none" else f" {ps.world_size}x{ps.strategy}"
        progress.update(task["id"], description=f"{item.label[:44]} mb{spec.micro_batch} "
                        f"s{spec.seq_len} {spec.precision} {spec.train}{ranks}")

    def on_row(item, row) -> None:
        progress.update(task["id"], advance=1)

    # a TERM (e.g. from `timeout`) ends the run like Ctrl-C: the child in flight is killed with it
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        report = collect(sweep, out=out, backend=backend, resume=resume, max_minutes=max_minutes,
                         record_history=record_history, on_start=on_start, on_row=on_row,
                         on_item=on_item)
    finally:
        if task:
            progress.stop()
    _summary(report)

