"""The job of a training run from its live objects, through the same readers as `--config`.

A running `Trainer` holds everything the config files would say: its `TrainingArguments` (a
TRL config is one, with its objective's keys), the model and its config (a quantised model's
config carries its `quantization_config`), the PEFT config of a wrapped model, the DeepSpeed /
FSDP settings and the world size. Rather than read those objects field by field (a second copy
of the readers, which would drift), each is turned into the file the command line would take
and handed to the same intake: `args.to_json_string()` is what `--training-args` reads (plus
`world_size`, which the arguments know only at run time), the model's config JSON is
`--model path/to/config.json`, the adapter's `to_dict()` is its `adapter_config.json`
(`save_pretrained` writes the same dict, sets as lists). So the job a callback builds is the
job `hybridmem predict` builds from the same settings (tests/test_integrations.py checks it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from hybridmem.errors import SpecError


def _plain(value: object) -> object:
    """A config dict as its JSON file holds it: sets as sorted lists (peft `to_dict` keeps
    `target_modules` a set; `PeftConfig.save_pretrained` writes it as a list)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    return value


def base_model(model: object) -> object:
    """The transformers model under a PEFT wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def model_config_path(model: object) -> str:
    """The model's config as a config.json file (content-addressed in hybridmem's cache):
    what `--model` takes. A quantised model's config keeps its `quantization_config`."""
    from hybridmem.models.loader import materialize_config

    config = getattr(base_model(model), "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        raise SpecError("model", type(model).__name__,
                        reason="has no transformers config (model.config)")
    return materialize_config(config.to_json_string(use_diff=False))


def peft_dict(model: object) -> dict | None:
    """The active adapter's config as its adapter_config.json holds it, or None."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    name = getattr(model, "active_adapter", None)
    name = name if isinstance(name, str) and name in configs else next(iter(configs))
    return _plain(configs[name].to_dict())


def training_args_dict(args: object, world_size: int | None = None) -> dict:
    """TrainingArguments (or a TRL config) as the JSON `--training-args` reads: its own
    `to_json_string()`, plus `world_size` (the run's, which a file cannot know)."""
    data = json.loads(args.to_json_string())
    ws = world_size if world_size is not None else getattr(args, "world_size", None)
    if ws is not None:
        data["world_size"] = int(ws)
    return data


@dataclass(frozen=True)
class LiveInputs:
    """The inputs `hybridmem predict` would get for a live run, as `resolve`'s arguments."""

    training_args: dict | None = None
    deepspeed: dict | None = None
    config: object | None = None
    """A launcher's config already read (`LauncherConfig`: the accelerate helper's)."""
    overrides: dict = field(default_factory=dict)
    """Job-schema keys (model, seq_len, ...) and the `peft_config` / `quantization_config`
    objects, as flags would give them."""
    names: dict = field(default_factory=dict)
    """How the job's sources name what came from live objects: the intake's label (`flag
    --model`, `training_args`) -> the object's (`model.config (NAME)`, `DPOConfig`)."""

    def renamed(self, sources: dict) -> dict:
        """`sources` in the live objects' names (a source left unnamed keeps its own)."""
        out = {}
        for key, source in sources.items():
            head, sep, tail = source.partition(": ")
            if source in self.names:
                out[key] = self.names[source]
            elif sep and head in self.names:
                out[key] = f"{self.names[head]}: {tail}"
            elif source.startswith("flag --"):
                out[key] = f"callback {key}="
            else:
                out[key] = source
        return out


def trainer_inputs(args: object, model: object, *, world_size: int | None = None,
                   seq_len: int | None = None, quantization_config: object | None = None,
                   **fields: object) -> LiveInputs:
    """A Trainer run's inputs: its arguments, its model's config and adapter, and what the
    caller states (`seq_len`, any other job field by schema key). A DeepSpeed config the
    arguments hold stays in them: the TrainingArguments reader reads it, as from a file."""
    overrides: dict = {"model": model_config_path(model), "seq_len": seq_len, **fields}
    adapter = peft_dict(model)
    if adapter is not None:
        overrides["peft_config"] = adapter
    if quantization_config is not None:
        to_dict = getattr(quantization_config, "to_dict", None)
        overrides["quantization_config"] = to_dict() if callable(to_dict) else quantization_config
    name = getattr(base_model(model).config, "_name_or_path", "") or type(base_model(model)).__name__
    names = {"flag --model": f"model.config ({name})", "training_args": type(args).__name__,
             "peft_config": "model.peft_config", "quantization_config": "quantization_config"}
    return LiveInputs(training_args=training_args_dict(args, world_size), overrides=overrides,
                      names=names)


def resolve_live(inputs: LiveInputs):
    """The resolved job (`Resolved`: the spec and each field's source) and the readers'
    warnings, by `hybridmem predict`'s intake."""
    from hybridmem.intake.config_keys import collect_warnings
    from hybridmem.intake.resolve import resolve

    with collect_warnings() as warnings:
        resolved = resolve(deepspeed=inputs.deepspeed, training_args=inputs.training_args,
                           overrides={k: v for k, v in inputs.overrides.items() if v is not None},
                           config=inputs.config)
    return type(resolved)(resolved.spec, inputs.renamed(resolved.sources)), list(warnings)
