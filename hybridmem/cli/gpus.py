"""`hybridmem gpus`: the GPU catalogue `--gpu` takes (`hybridmem.gpus.GPUS`)."""

from __future__ import annotations

import json

import typer


def rows() -> list[dict]:
    """One dict per catalogued GPU: name, memory (bytes and GiB), compute capability, arch."""
    from hybridmem.gpus import GPUS, GiB

    return [{"name": g.name, "memory_bytes": g.memory_bytes,
             "memory_gib": round(g.memory_bytes / GiB, 2),
             "compute_capability": ".".join(map(str, g.compute_capability or ())) or None,
             "arch": g.arch, "source": g.source} for g in GPUS.values()]


def gpus_command(
    as_json: bool = typer.Option(False, "--json", help="One JSON object per GPU, a list."),
) -> None:
    """List the GPUs --gpu accepts: memory as CUDA reports it, compute capability."""
    table = rows()
    if as_json:
        typer.echo(json.dumps(table, indent=1))
        return
    from rich.console import Console
    from rich.table import Column, Table

    out = Table("gpu", Column("memory GiB", justify="right"), "compute capability", "arch",
                box=None)
    for r in table:
        out.add_row(r["name"], f"{r['memory_gib']:.2f}", r["compute_capability"] or "-",
                    r["arch"])
    Console(width=100).print(out)
    typer.echo("Any other GPU: --gpu-mem GIB (its total as nvidia-smi prints it, / 1024).")


def register(app: typer.Typer) -> None:
    app.command("gpus")(gpus_command)
