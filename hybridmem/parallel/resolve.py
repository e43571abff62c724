"""The job from everything a user gives: flags, a recipe, config files, a launcher's config.

Why its own module: the launcher readers (`hybridmem.parallel.launchers`) build on the
TrainingArguments / DeepSpeed readers of `hybridmem.parallel.inputs`, so the layering that
takes a `--config` file sits above both (`inputs` never imports the launchers).
"""

from __future__ import annotations

import os

from hybridmem.errors import SpecError
from hybridmem.parallel.inputs import Resolved, resolve_inputs
from hybridmem.parallel.launchers import LauncherConfig, read_config


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
        model = (overrides or {}).get("model")
        launched = None if config is None else read_config(config, config_format, model)
    return resolve_inputs(recipe, deepspeed, training_args, overrides, launched)

