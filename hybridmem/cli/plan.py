"""`hybridmem plan`: price a grid (GPU type x GPU count x micro-batch x seq x strategy x precision)
and print the cheapest configurations that fit, as a table or as JSON.

The base job takes `predict`'s job options and config files; each grid axis given replaces that
field. "Cheapest" is the GPU memory bought, GPU count x the GPU's memory (the catalogue has no
prices; memory is what a cloud price scales with inside one GPU generation), then fewer GPUs,
then the most tokens per GPU per step (micro-batch x seq: the throughput the money buys), then a
clean fit before one that needs the allocator's retry, then the most headroom. Points the job's
checks refuse (a strategy the GPU count does not allow) are counted, not priced twice.
"""

from __future__ import annotations

import inspect
import itertools
import json
from typing import Optional

import typer

from hybridmem.errors import SpecError

GiB = 2**30
AXES: dict[str, tuple[str, type, str]] = {
    "gpus": ("--gpus", str, "GPU types from the catalogue, comma-separated (hybridmem gpus)."),
    "gpu_counts": ("--gpu-counts", int, "GPUs per job, comma-separated, e.g. 1,2,4,8."),
    "micro_batches": ("--micro-batches", int, "Micro-batches per GPU, e.g. 1,2,4,8."),
    "seq_lens": ("--seq-lens", int, "Sequence lengths, e.g. 1024,2048,4096."),
    "strategies": ("--strategies", str, "Strategies for more than one GPU, e.g. ddp,zero3,fsdp."),
    "precisions": ("--precisions", str, "Precisions, e.g. bf16-mixed,bf16-master."),
}
"""Grid option -> (flag, item type, help). An axis not given keeps the base job's value."""
FIELD_OF_AXIS: dict[str, str] = {"gpu_counts": "world_size", "micro_batches": "micro_batch",
                                 "seq_lens": "seq_len", "precisions": "precision"}
DEFAULT_GPUS = "a100-40gb,a100-80gb,h100-80gb,h200"
DEFAULT_COUNTS = "1,2,4,8"
DEFAULT_STRATEGIES = "ddp,zero2,zero3,fsdp"
PLAN_SKIPS = ("gpu", "gpu_mem", "find_max_batch", "method", "plot", "timeline", "verbose",
              "as_json", "jobs", "workers", "layouts", "world_size", "strategy", "zero_stage")
"""`predict` options the plan does not take: the grid sets the GPU and the layout."""


def axis(name: str, text: str) -> list:
    """A comma-separated grid axis as its items (each an int where the axis counts)."""
    flag, kind, _ = AXES[name]
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise SpecError(flag, text, reason="needs at least one value")
    if kind is int:
        bad = [t for t in items if not t.isdigit() or int(t) < 1]
        if bad:
            raise SpecError(flag, bad[0], reason="must be positive whole numbers, comma-separated")
        return [int(t) for t in items]
    return items


def grid(base: dict, axes: dict) -> list[dict]:
    """One item per grid point: the base values with the axes' fields set, and its GPU. One GPU
    is priced without a strategy (`none`); more than one with each strategy."""
    from hybridmem.gpus import gpu_by_name

    for name in axes["gpus"]:
        gpu_by_name(name)  # an unknown GPU is the command's error, not every row's
    fields = [(FIELD_OF_AXIS[a], axes[a]) for a in FIELD_OF_AXIS if axes.get(a)]
    out = []
    for gpu in axes["gpus"]:
        for combo in itertools.product(*(values for _, values in fields)):
            point = dict(zip((f for f, _ in fields), combo))
            count = point.get("world_size", 1)
            for strategy in (["none"] if count == 1 else axes["strategies"]):
                out.append({"values": {**base, **point, "strategy": strategy}, "gpu": gpu})
    return out


def price_point(item: dict) -> dict:
    """One grid point's row: the layout, the device peak per GPU, the verdict. Module-level so
    that it pickles to a worker (`hybridmem.fanout`)."""
    from hybridmem.answer import resolve_gpu, resolve_job
    from hybridmem.predict import predict

    resolved, _ = resolve_job(item["values"])
    spec, gpu = resolved.spec, resolve_gpu(item["gpu"], None)
    result = predict(spec, gpu=gpu)
    return {"gpu": gpu.name, "gpu_count": spec.parallel.world_size,
            "strategy": spec.parallel.strategy, "micro_batch": spec.micro_batch,
            "seq_len": spec.seq_len, "precision": result.job["precision"],
            "gpu_memory_bought_bytes": gpu.memory_bytes * spec.parallel.world_size,
            "device_bytes": result.peak.device_bytes, "fit": result.fit,
            "headroom_bytes": result.headroom_bytes, "method": result.method}


def cost_key(row: dict) -> tuple:
    """The "cheapest" order (module docstring)."""
    return (row["gpu_memory_bought_bytes"], row["gpu_count"],
            -row["micro_batch"] * row["seq_len"], row["fit"] != "yes", -row["headroom_bytes"])


def plan(base: dict, axes: dict, workers: int | None = None) -> dict:
    """Every grid point priced; the fitting ones cheapest first (`cost_key`); the refused ones
    with their reason."""
    from hybridmem.fanout import price_many

    items = grid(base, axes)
    rows = price_many(price_point, items, workers)
    priced = [r for r in rows if "error" not in r]
    refused = [{"gpu": i["gpu"], **{k: i["values"].get(k) for k in
                                   ("world_size", "strategy", "micro_batch", "seq_len",
                                    "precision")}, "error": r["error"]}
               for i, r in zip(items, rows) if "error" in r]
    fitting = sorted((r for r in priced if r["fit"] in ("yes", "after-retry")), key=cost_key)
    return {"points": len(items), "priced": len(priced), "fit": len(fitting),
            "cheapest": fitting, "no_fit": [r for r in priced if r not in fitting],
            "refused": refused, "axes": axes}


def table_lines(answer: dict, top: int) -> list[str]:
    """The console's table: the `top` cheapest that fit, one per line."""
    head = f"{answer['points']} configurations, {answer['priced']} priced, {answer['fit']} fit"
    if answer["refused"]:
        head += f", {len(answer['refused'])} refused ({answer['refused'][0]['error']})"
    lines = [head]
    if not answer["cheapest"]:
        return lines + ["none fits: try more GPUs, a larger GPU, a smaller micro-batch or seq"]
    lines.append(f"{'gpu':<11} {'GPUs':>4} {'strategy':<8} {'micro':>5} {'seq':>6} "
                 f"{'precision':<12} {'GiB/GPU':>8} {'headroom':>8}  fit")
    for r in answer["cheapest"][:top]:
        lines.append(f"{r['gpu']:<11} {r['gpu_count']:>4} {r['strategy']:<8} "
                     f"{r['micro_batch']:>5} {r['seq_len']:>6} {str(r['precision']):<12} "
                     f"{r['device_bytes'] / GiB:>8.2f} {r['headroom_bytes'] / GiB:>8.2f}  {r['fit']}")
    return lines


def plan_command(**values) -> None:
    """Price a grid of GPUs x micro-batch x seq x strategy x precision; the cheapest that fit."""
    top, as_json, workers = values.pop("top"), values.pop("as_json"), values.pop("workers")
    axes = {name: axis(name, values.pop(name)) if values.get(name) else None for name in AXES}
    axes["gpus"] = axes["gpus"] or axis("gpus", DEFAULT_GPUS)
    axes["gpu_counts"] = axes["gpu_counts"] or axis("gpu_counts", DEFAULT_COUNTS)
    axes["strategies"] = axes["strategies"] or axis("strategies", DEFAULT_STRATEGIES)
    for name in AXES:
        values.pop(name, None)
    answer = plan(values, axes, workers)
    if as_json:
        typer.echo(json.dumps(answer, indent=1))
    else:
        typer.echo("\n".join(table_lines(answer, top)))


def _signature() -> inspect.Signature:
    from hybridmem.cli.predict import option_params

    params = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=tp)
              for _, name, tp, info in option_params() if name not in PLAN_SKIPS]
    own = [(name, Optional[str], typer.Option(None, flag, help=help_, rich_help_panel="Grid"))
           for name, (flag, _, help_) in AXES.items()]
    own += [("top", int, typer.Option(10, "--top", help="Rows of the table.",
                                      rich_help_panel="Grid")),
            ("workers", Optional[int], typer.Option(None, "--workers", help="Worker processes "
                                                    "(default: the CPUs available).",
                                                    rich_help_panel="Grid")),
            ("as_json", bool, typer.Option(False, "--json", help="One JSON object: every "
                                           "point, the cheapest first.", rich_help_panel="Grid"))]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=tp)
               for name, tp, info in own]
    return inspect.Signature(params)


EXAMPLES = """Examples:
  hybridmem plan --model llama-3.1-8b --micro-batches 1,2,4,8 --seq-lens 2048,4096
  hybridmem plan --model llava-1.5-7b --train lora --gpus l40s,a100-80gb --gpu-counts 1,2 --json
Defaults: --gpus a100-40gb,a100-80gb,h100-80gb,h200 --gpu-counts 1,2,4,8
--strategies ddp,zero2,zero3,fsdp; micro-batch, seq and precision: the job's."""


def register(app: typer.Typer) -> None:
    from hybridmem.cli.help import CompactHelp

    plan_command.__signature__ = _signature()
    app.command("plan", cls=CompactHelp, epilog=EXAMPLES)(plan_command)
