"""The job from everything a user gives: flags, a recipe, config files, a launcher's config.

Why its own module: the launcher dialects (`hybridmem.intake.dialects`) build on the
TrainingArguments / DeepSpeed readers (`hybridmem.intake.readers`), so what reads a `--config`
file and stacks it with the rest (`hybridmem.intake.merge`) sits above both.
"""

from __future__ import annotations

import os

from hybridmem.errors import SpecError
from hybridmem.intake.merge import Resolved, resolve_inputs
from hybridmem.intake.dialects import LauncherConfig, read_config
from hybridmem.job.spec import TrainingSpec


def resolve(recipe: str | None = None, deepspeed: str | os.PathLike | dict | None = None,
            training_args: str | os.PathLike | dict | None = None,
            overrides: dict | None = None,
            config: str | os.PathLike | LauncherConfig | None = None,
            config_format: str | None = None) -> Resolved:
    """The validated job and where each non-default field came from. Layers, lowest first:
    recipe < launcher config (`config`, in `config_format` or the one its keys tell) <
    training args < DeepSpeed < explicit overrides (job-schema keys)."""
    if config is None and config_format is not None:
        raise SpecError("config_format", config_format, reason="needs --config FILE")
    if isinstance(config, LauncherConfig):  # read already (the HTTP API's pasted text)
        launched = config
    else:
        launched = None if config is None else read_config(config, config_format)
    return resolve_inputs(recipe, deepspeed, training_args, overrides, launched)


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
