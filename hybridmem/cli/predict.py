"""`hybridmem predict`: options -> TrainingSpec -> predict() -> table / JSON / plot.

The job options are generated from the job schema (`hybridmem.job.schema`: one option per
field declared with a CLI name, in its group's help panel); the options that are not job fields
(config files, the GPU, the output) are declared once in `hybridmem.job.options`, which the
HTTP API reads too. Option names are a contract other tools script against; keep them stable.
"""

from __future__ import annotations

import inspect
import json
from typing import Optional

import typer

from hybridmem.answer import resolve_gpu  # noqa: F401  (the CLI's GPU options, shared)
from hybridmem.errors import SpecError
from hybridmem.job import schema
from hybridmem.job.field import GROUPS
from hybridmem.job.options import CLI_OPTIONS, Option

OTHER_OPTIONS: tuple[Option, ...] = CLI_OPTIONS
"""The `predict` options that are not job fields (a file, the GPU, the output)."""

EXAMPLES = """Examples:
  hybridmem predict --model llava-1.5-7b --train lora --grad-ckpt --gpu rtx-4090
  hybridmem predict --model path/to/config.json --gpu-mem 24 --find-max-batch
  hybridmem predict --model llama-3.2-3b --deepspeed ds.json --gpu h200 --json
GPUs: hybridmem gpus. Grids: hybridmem plan. --jobs, every key: README."""
"""The help's epilog (`cli.help.CompactHelp` prints it as written)."""


def panel_title(panel: str) -> str:
    """The help panel's title: a job group's, or the panel name itself."""
    return GROUPS.get(panel, panel)


def option_params() -> list[tuple[str, str, object, object]]:
    """(panel title, parameter name, annotation, typer Option) of every `predict` option, in
    help order: the job groups (each group's schema fields, then its other options), then the
    config files, then the GPU and output options."""
    out = []
    for group, metas in schema.by_group().items():
        for meta in metas:
            if not meta.cli:
                continue
            tp = schema.value_type(schema.TYPES[meta.key])
            required = False  # --model, or a --config that names the model
            info = typer.Option(... if required else None, *meta.cli,
                                help=schema.option_help(meta),
                                metavar=meta.unit.upper() if meta.unit else None,
                                rich_help_panel=panel_title(group))
            out.append((panel_title(group), meta.key, tp if required else Optional[tp], info))
        for opt in OTHER_OPTIONS:
            if opt.panel == group:
                out.append(_other(opt))
    out += [_other(opt) for opt in OTHER_OPTIONS if opt.panel not in GROUPS]
    return out


def _other(opt: Option):
    info = typer.Option(opt.default, *opt.decls, help=opt.help,
                        rich_help_panel=panel_title(opt.panel))
    return panel_title(opt.panel), opt.name, opt.type, info


def predict_command(**values) -> None:
    """Predict the peak GPU memory of one training configuration."""
    from hybridmem.answer import answer, resolve_job
    from hybridmem.report import plot as save_plot, render

    from hybridmem.parallel.cli import fit_lines

    gpu, gpu_mem, method = values.pop("gpu"), values.pop("gpu_mem"), values.pop("method")
    find_max_batch, as_json = values.pop("find_max_batch"), values.pop("as_json")
    plot, timeline = values.pop("plot"), values.pop("timeline")
    verbose = values.pop("verbose")
    jobs, workers, layouts = values.pop("jobs"), values.pop("workers"), values.pop("layouts")
    if jobs is not None and layouts:
        raise SpecError("layouts", True, reason="advises one job: not with --jobs")
    if jobs is not None:
        return _jobs_command(jobs, workers, values, as_json, plot or timeline,
                             {"gpu": gpu, "gpu_mem": gpu_mem, "method": method,
                              "find_max_batch": find_max_batch})
    if workers is not None:
        raise SpecError("workers", workers, reason="needs --jobs FILE.jsonl")
    if layouts:
        return _layouts(values, resolve_gpu(gpu, gpu_mem), as_json)
    # recipe < --training-args < --deepspeed < explicit flags (None = flag not given); the rest
    # of `values` are the job fields by schema key, --peft-config, --quantization-config and
    # --zero-stage
    resolved, config_warnings = resolve_job(values)
    for warning in config_warnings:  # keys of the user's files that were not read
        typer.echo(f"warning: {warning}", err=True)
    target = resolve_gpu(gpu, gpu_mem)
    found = answer(resolved, config_warnings, target, method=method,
                   find_max_batch=find_max_batch, timeline=timeline)
    result, advice = found.result, found.advice
    for warning in result.job["warnings"][len(config_warnings):]:  # the job's own: before it
        typer.echo(f"warning: {warning}", err=True)
    written = []
    if plot:
        written.append(f"plot: {save_plot(result, plot)}")
        if "lengths" in result.extras:
            from hybridmem.report import steps_plot

            written.append(f"plot: {steps_plot(result, plot)}")
    if "timeline" in result.extras:
        written.append(f"timeline: {result.extras['timeline']}")
    if as_json:
        typer.echo(json.dumps(found.to_dict(), indent=2))
    else:
        render(result, verbose=verbose)
        if advice is not None:
            typer.echo("\n".join(fit_lines(advice)))
    for line in written:  # on stderr under --json, so stdout stays one JSON object
        typer.echo(f"wrote {line}", err=as_json)


def _jobs_command(path: str, workers: int | None, values: dict, as_json: bool,
                  output: str | None, how: dict) -> None:
    """`predict --jobs`: a row per line (`hybridmem.cli.jobs`), JSON lines under --json."""
    from hybridmem.cli.jobs import row_text, run_jobs

    if output is not None:
        raise SpecError("jobs", path, reason="--plot and --timeline draw one job: not with --jobs")
    rows = run_jobs(path, values, how, workers)
    for row in rows:
        typer.echo(json.dumps(row) if as_json else row_text(row))
    failed = sum("error" in row for row in rows)
    typer.echo(f"{len(rows)} jobs, {len(rows) - failed} priced, {failed} errors", err=True)
def _layouts(values: dict, gpu, as_json: bool) -> None:
    """`--layouts`: the advice over layouts (`hybridmem.parallel.layouts.advise`)."""
    from hybridmem.answer import resolve_job
    from hybridmem.errors import SpecError
    from hybridmem.parallel.layouts import advise

    if gpu is None:
        raise SpecError("gpu", None, reason="--layouts needs the GPU to fit (--gpu or --gpu-mem)")
    resolved, config_warnings = resolve_job(values)
    for warning in config_warnings:
        typer.echo(f"warning: {warning}", err=True)
    spec = resolved.spec
    found = advise(spec, spec.parallel.world_size, gpu)
    if as_json:
        typer.echo(json.dumps({"job": spec.to_dict(), **found}, indent=2))
        return
    G = 2**30
    typer.echo(f"layouts of {found['gpus']} x {found['gpu']} for {spec.model}, micro-batch "
               f"{spec.micro_batch} x {spec.seq_len} tokens ({spec.precision}, "
               f"grad_ckpt={'on' if spec.grad_ckpt else 'off'}); per-rank peak, analytic:")
    typer.echo(f"{'dp':>5} {'tp':>3} {'pp':>3} {'cp':>3}  {'strategy':<8} {'peak GiB':>9} "
               f"{'headroom':>9}  fits")
    for r in found["rows"]:
        typer.echo(f"{r['dp']:>5} {r['tp']:>3} {r['pp']:>3} {r['cp']:>3}  {r['strategy']:<8} "
                   f"{r['peak_bytes'] / G:>9.2f} {r['headroom_bytes'] / G:>+9.2f}  "
                   f"{'yes' if r['fits'] else 'no'}")
    smallest = found["smallest_gpus"]
    typer.echo(f"smallest GPU count that fits: {smallest}" if smallest else
               "no layout of up to 16384 GPUs fits")


predict_command.__signature__ = inspect.Signature([
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=tp)
    for _, name, tp, info in option_params()])


def register(app: typer.Typer) -> None:
    from hybridmem.cli.help import CompactHelp

    app.command("predict", cls=CompactHelp, epilog=EXAMPLES)(predict_command)
