"""Pure functions behind `hybridmem predict`: the options -> the TrainingSpec, the fit advice ->
console lines.

`spec_from_cli` takes the raw option values (None = not given on the command line) and returns
the TrainingSpec; `fit_lines` turns `smallest_fitting_setup`'s answer into console lines.
"""

from __future__ import annotations

from hybridmem.parallel.inputs import Resolved
from hybridmem.parallel.resolve import resolve
from hybridmem.job.spec import TrainingSpec

GiB = 2**30


def resolve_cli(*, model: str | None = None, recipe: str | None = None,
                deepspeed: str | None = None, training_args: str | None = None,
                config: str | None = None, config_format: str | None = None,
                **values: object) -> Resolved:
    """Recipe < launcher config < training args < DeepSpeed JSON < explicit flags, and where
    each field came from. `values` are the other options by job-schema key
    (`hybridmem.job.schema.BY_KEY`: micro_batch, precision, world_size, strategy, lora_r, ...),
    plus zero_stage, peft_config and quantization_config (files); None means "not given"."""
    return resolve(recipe=recipe, deepspeed=deepspeed, training_args=training_args,
                   overrides={"model": model, **values}, config=config,
                   config_format=config_format)


def spec_from_cli(**options: object) -> TrainingSpec:
    """`resolve_cli`'s TrainingSpec."""
    return resolve_cli(**options).spec


def _describe(option: dict) -> str:
    parts = [f"{option['world_size']} GPU(s)", option["strategy"]]
    if "micro_batch" in option:
        parts.append(f"micro-batch {option['micro_batch']}")
    parts.append(f"checkpointing {'on' if option['grad_ckpt'] else 'off'}")
    return (", ".join(parts) + f": {option['peak_bytes'] / GiB:.1f} GiB per GPU "
            f"({option['headroom_bytes'] / GiB:+.1f} GiB headroom)")


def fit_lines(advice: dict) -> list[str]:
    """Console lines for `smallest_fitting_setup`'s answer."""
    gpu = f"{advice['gpu']} ({advice['gpu_memory_bytes'] / GiB:.1f} GiB)"
    if advice["fits_as_is"]:
        return [f"fits {gpu} as configured: {_describe(advice['current'])}"]
    lines = [f"does not fit {gpu}: {_describe(advice['current'])}"]
    labels = {"world_size": "smallest world size", "zero_stage": "ZeRO stage at this size",
              "grad_ckpt": "gradient checkpointing", "micro_batch": "largest micro-batch"}
    for key, label in labels.items():
        if advice.get(key) is not None:
            lines.append(f"  {label}: {_describe(advice[key])}")
    for combined in advice.get("combined") or ():
        lines.append(f"  {combined['changes']}: {_describe(combined)}")
    if len(lines) == 1:
        lines.append("  no change searched fits (world size, ZeRO stage, micro-batch, and "
                     "checkpointing, Liger or Cut Cross-Entropy with a smaller micro-batch or "
                     "more GPUs)")
    return lines
