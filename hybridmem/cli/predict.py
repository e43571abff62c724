"""`hybridmem predict`: options -> TrainingSpec -> predict() -> table / JSON / plot.

The job options are generated from the job schema (`hybridmem.job.schema`: one option per
field declared with a CLI name, in its group's help panel); the options that are not job fields
(config files, the GPU, the output) are declared in `OTHER_OPTIONS`. Option names are a
contract other tools script against; keep them stable.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Optional

import typer

from hybridmem.answer import resolve_gpu  # noqa: F401  (the CLI's GPU options, shared)
from hybridmem.errors import SpecError
from hybridmem.job import schema
from hybridmem.job.field import GROUPS

FILES_PANEL = "Config files you already have"
OUTPUT_PANEL = "GPU and output"


@dataclass(frozen=True)
class CliOption:
    """A `predict` option that is not a job field (a file, the GPU, the output)."""

    name: str
    """Parameter name (what `predict_command` receives)."""
    decls: tuple[str, ...]
    type: object
    help: str
    panel: str
    """A `GROUPS` key (the job panel it belongs next to) or a panel title."""
    default: object = None
    doc: str | None = None
    """Longer markdown for the README options table (else `help`)."""


OTHER_OPTIONS: tuple[CliOption, ...] = (
    CliOption("peft_config", ("--peft-config",), Optional[str],
              "PEFT adapter_config.json (LoRA/DoRA: analytic; any other method: trace).",
              "adapters",
              doc="a PEFT `adapter_config.json`: LoRA / DoRA / rsLoRA / `modules_to_save` become "
              "`train=lora` (analytic and trace); any other method (IA3, prompt/prefix/p-tuning, "
              "VeRA, OFT, LoHa, LoKr, AdaLoRA, ...) becomes `train=peft`, priced by the trace "
              "tier, which `predict` then picks without `--method` "
              "([docs/peft.md](docs/peft.md))"),
    CliOption("quantization_config", ("--quantization-config",), Optional[str],
              "BitsAndBytesConfig JSON (or a config.json carrying quantization_config).",
              "precision"),
    CliOption("zero_stage", ("--zero-stage",), Optional[int],
              "DeepSpeed ZeRO stage 1, 2 or 3 (= --strategy zeroN).", "parallel"),
    CliOption("recipe", ("--recipe",), Optional[str],
              "llava-1.5-{pretrain,finetune,finetune-lora} (official LLaVA-1.5 scripts).",
              FILES_PANEL),
    CliOption("training_args", ("--training-args",), Optional[str],
              "HF TrainingArguments (or TRL SFTConfig) fields as JSON.", FILES_PANEL,
              doc="HF `TrainingArguments` fields as JSON (`args.to_json_string()`; TRL "
              "`SFTConfig` and LLaVA's extensions too): the keys in the last column set the "
              "job, Trainer's defaults fill the rest (micro-batch 8, `max_grad_norm` 1.0); "
              "a key that is neither read nor a known TrainingArguments field is a warning "
              "naming the nearest known key"),
    CliOption("deepspeed", ("--deepspeed",), Optional[str],
              "DeepSpeed config JSON ('auto' resolved as transformers does).", FILES_PANEL),
    CliOption("config", ("--config",), Optional[str],
              "YAML of LLaMA-Factory, axolotl, torchtune or accelerate.", FILES_PANEL,
              doc="a launcher's own training YAML (LLaMA-Factory `llamafactory-cli train`, "
              "axolotl, torchtune recipe configs, accelerate's `accelerate config` file: "
              "distributed_type, mixed_precision, num_processes, fsdp_config / "
              "deepspeed_config; it names no model), read as that launcher reads it: its "
              "defaults where the file is silent, its model (a hub id names its preset), "
              "its `deepspeed` / `fsdp_config`; flags and the other files override it. Every "
              "key is read, known to the launcher, or a warning naming the nearest key"),
    CliOption("config_format", ("--config-format",), Optional[str],
              "llamafactory, axolotl, torchtune or accelerate (default: by keys).",
              FILES_PANEL),
    CliOption("jobs", ("--jobs",), Optional[str],
              "Many jobs: a JSONL file, one job per line (the `job` names); answers in order.",
              FILES_PANEL,
              doc="a JSONL file, one job per line with the `job` object's names (an answer's "
              "`job` is a valid line; `gpu`, `gpu_mem`, `method`, `find_max_batch` and the "
              "config files may be set per line; the other options are every line's "
              "defaults): answered in order, priced in `--workers` processes, each job's "
              "error in its own row; `--json` prints one JSON object per line "
              "([docs/many-jobs.md](docs/many-jobs.md))"),
    CliOption("workers", ("--workers",), Optional[int],
              "With --jobs: worker processes (default: the CPUs available).", FILES_PANEL),
    CliOption("gpu", ("--gpu",), Optional[str],
              "GPU from the catalogue, e.g. h100-80gb, a100-40gb, h200.", OUTPUT_PANEL,
              doc="catalogue in `hybridmem/gpus.py` (A100 40/80 GB, H100, H200, L40S, RTX "
              "4090, …, each total with its source)"),
    CliOption("gpu_mem", ("--gpu-mem",), Optional[float],
              "GPU memory in GiB (instead of --gpu).", OUTPUT_PANEL),
    CliOption("find_max_batch", ("--find-max-batch",), bool,
              "Search the largest micro-batch that fits the GPU.", OUTPUT_PANEL, default=False),
    CliOption("method", ("--method",), Optional[str],
              "analytic, trace or hybrid (default: chosen per job).",
              OUTPUT_PANEL,
              doc="`analytic`, `trace` or `hybrid`; default: hybrid when a GPU-calibrated "
              "learned model (shipped with hybridmem, or in `$HYBRIDMEM_MODELS`) applies to "
              "this torch, else analytic; trace for PEFT methods and model families only it "
              "can price. `method` and `method_reason` in the answer say which and why"),
    CliOption("as_json", ("--json",), bool,
              "Print one JSON object instead of tables.", OUTPUT_PANEL, default=False,
              doc="print one JSON object (schema below) instead of tables"),
    CliOption("plot", ("--plot",), Optional[str],
              "Save a stacked bar chart (PNG/SVG/PDF) to FILE.", OUTPUT_PANEL,
              doc="save a stacked bar chart (PNG/SVG/PDF) to FILE; with `--lengths` also the "
              "reserved bytes per step as FILE's name + `.steps`"),
    CliOption("timeline", ("--timeline",), Optional[str],
              "(trace) Save the memory timeline as JSON or PNG.", OUTPUT_PANEL),
    CliOption("verbose", ("--verbose", "-v"), bool,
              "Print every note, not only the three that matter most.", OUTPUT_PANEL,
              default=False,
              doc="print every note; by default the console shows at most three: the tier "
              "and why, the verdict's caveat, the assumption that changes the answer most "
              "(`--json` keeps them all)"),
)

EXAMPLES = """Examples:
  hybridmem predict --model llava-1.5-7b --train lora --grad-ckpt --gpu rtx-4090
  hybridmem predict --model path/to/config.json --gpu-mem 24 --find-max-batch
  hybridmem predict --model llama-3.2-3b --deepspeed ds.json --gpu h200 --json
The GPUs: hybridmem gpus. Every choice and config key: README "Options"."""
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


def _other(opt: CliOption):
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
    jobs, workers = values.pop("jobs"), values.pop("workers")
    if jobs is not None:
        return _jobs_command(jobs, workers, values, as_json, plot or timeline,
                             {"gpu": gpu, "gpu_mem": gpu_mem, "method": method,
                              "find_max_batch": find_max_batch})
    if workers is not None:
        raise SpecError("workers", workers, reason="needs --jobs FILE.jsonl")
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


predict_command.__signature__ = inspect.Signature([
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=tp)
    for _, name, tp, info in option_params()])


def register(app: typer.Typer) -> None:
    from hybridmem.cli.help import CompactHelp

    app.command("predict", cls=CompactHelp, epilog=EXAMPLES)(predict_command)
