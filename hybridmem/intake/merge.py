"""The layers a job is read from, merged: recipe < launcher config < TrainingArguments <
DeepSpeed JSON < explicit values (flags, or the HTTP request's fields), each field with where it
came from.

Each reader (`hybridmem.intake.readers`, `hybridmem.intake.dialects`) returns one layer
(`{"spec", "parallel", "lora", "sources", "label"}`); `resolve_inputs` stacks them, resolves
the DeepSpeed "auto" values from the TrainingArguments below them, and returns the validated
TrainingSpec with the sources of the fields it does not leave at the schema default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hybridmem.errors import SpecError
from hybridmem.intake.readers.bnb import quantization
from hybridmem.intake.readers.common import layer_values
from hybridmem.intake.readers.deepspeed import from_deepspeed_json, hidden_size_of
from hybridmem.intake.readers.peft import from_peft_config
from hybridmem.intake.readers.trainer import (
    HF_DEFAULT_BATCH, HF_DEFAULTS, OPTION_FILES, TRAINER_DEFAULT, from_training_args,
)
from hybridmem.intake.recipes import RECIPES
from hybridmem.job import schema
from hybridmem.job.parallel import ParallelSpec
from hybridmem.job.precision import deepspeed_precision
from hybridmem.job.spec import LoraSpec, TrainingSpec
from hybridmem.models import hub
from hybridmem.parallel.validate import check_parallel


def flag_source(key: str) -> str:
    """How the job names a value given on the command line: the option it was given as."""
    meta = schema.BY_KEY.get(key)
    if meta is not None and meta.cli:
        return "flag " + meta.cli[0].split("/")[0]
    return "flag --" + key.replace("_", "-")


REGEX_CHARS = frozenset("()[]*+?|\\^$")
"""Characters of a regular expression no module name has (`--lora-targets` as one regex)."""


def _layer_overrides(overrides: dict, model: str | None = None) -> dict:
    """Explicit values by job-schema key (`hybridmem.job.schema.BY_KEY`: TrainingSpec and
    ParallelSpec field names, `lora_<field>` for LoRA settings), plus the files given as
    options (`peft_config`, `quantization_config`) and `zero_stage`. `model`: the job's model
    (the flag's, else the launcher config's), whose config.json may hold a quantization_config.
    A hub id given as `model` becomes its preset (`hybridmem.models.hub`)."""
    spec, parallel, lora, sources = {}, {}, {}, {}
    if overrides.get("peft_config") is not None:  # first, so --lora-* flags refine it
        spec, lora, sources = from_peft_config(overrides["peft_config"], overrides.get("train"))
    quant, quant_sources = quantization(overrides, model)
    spec.update(quant)
    sources.update(quant_sources)
    layer = {"spec": spec, "parallel": parallel, "lora": lora, "sources": sources,
             "label": "flag"}
    for key, value in overrides.items():
        if value is None or key in OPTION_FILES:
            continue
        meta = schema.BY_KEY.get(key)
        if key == "lora_targets" and isinstance(value, str) and REGEX_CHARS & set(value):
            # no module name has these: the value is one peft regex (`lora.target_regex`)
            lora["target_regex"] = value
            sources["lora_target_regex"] = flag_source(key)
            continue
        if key == "lora_targets":  # names given: a file's regex no longer applies
            lora["target_regex"] = None
        if meta is not None:
            value = schema.parse_cli(meta, value)
            sources[key] = flag_source(key)
            if key == "model" and hub.resolve(value) != value:
                sources[key] += f" ({value})"
                value = hub.resolve(value)
            layer[meta.owner][meta.name] = value
        elif key == "zero_stage":
            if value not in (1, 2, 3):
                raise SpecError("zero_stage", value, [1, 2, 3])
            parallel["strategy"] = f"zero{value}"
            sources["strategy"] = "flag --zero-stage"
        else:
            raise SpecError("overrides", key, sorted((*schema.BY_KEY, "zero_stage", *OPTION_FILES)))
    return layer


@dataclass(frozen=True)
class Resolved:
    """A job resolved from its inputs, and where each of its non-default fields came from."""

    spec: TrainingSpec
    sources: dict[str, str]
    """Flat job-schema key -> "flag --x", "FILE: key", "launcher default (...)", "recipe NAME:
    key", ...: every field not at the schema default (`job["sources"]` in `--json`)."""


def resolve_inputs(recipe: str | None = None, deepspeed: str | os.PathLike | dict | None = None,
                   training_args: str | os.PathLike | dict | None = None,
                   overrides: dict | None = None, launched=None) -> Resolved:
    """The validated TrainingSpec of the inputs (parallel settings checked against the rest) and
    its fields' sources. Layers, lowest first: recipe < launcher config (`launched`: a
    `hybridmem.intake.dialects.LauncherConfig`, its launcher's defaults and its keys) <
    training args < DeepSpeed < explicit overrides (`hybridmem.intake.resolve` reads a
    `--config` file and calls this)."""
    kwargs, sources = _merge(recipe, deepspeed, training_args, overrides, launched)
    if "model" not in kwargs:
        raise SpecError("model", None, reason="give --model (or a --config that names one)")
    spec = TrainingSpec(**kwargs)
    check_parallel(spec)
    return Resolved(spec, _non_default(spec, sources))


def merge_inputs(recipe: str | None = None, deepspeed: str | os.PathLike | dict | None = None,
                 training_args: str | os.PathLike | dict | None = None,
                 overrides: dict | None = None) -> dict:
    """TrainingSpec keyword arguments from the inputs; explicit `overrides` win over files, files
    over the recipe, and a file read as a Trainer run (a recipe, TrainingArguments) starts from
    Trainer's default batch. `overrides` take job-schema keys (`_layer_overrides`); None values
    are ignored."""
    return _merge(recipe, deepspeed, training_args, overrides, None)[0]


def _launched_model(launched) -> str | None:
    """The launcher config's model as the file names it (its hub id, whose config.json may
    carry a pre-quantised upload's quantization_config), else its preset or path."""
    if launched is None:
        return None
    return next((layer["hub_id"] for layer in launched.layers if layer.get("hub_id")),
                launched.model)


def _merge(recipe, deepspeed, training_args, overrides, launched) -> tuple[dict, dict]:
    overrides = overrides or {}
    over = _layer_overrides(overrides, overrides.get("model") or _launched_model(launched))
    layers: list[dict] = []
    ds_sources: list[tuple] = []  # (DeepSpeed config, where it came from)
    hf: dict | None = None
    if recipe is not None or training_args is not None:
        # a Trainer run: TrainingArguments' own default batch where no file sets one
        layers.append({"spec": {"micro_batch": HF_DEFAULT_BATCH}, "parallel": {}, "lora": {},
                       "label": TRAINER_DEFAULT})
    if recipe is not None:
        if recipe not in RECIPES:
            raise SpecError("recipe", recipe, sorted(RECIPES))
        ta = from_training_args(RECIPES[recipe]["training_args"], where=f"recipe {recipe}")
        ta["spec"].update(RECIPES[recipe].get("spec", {}))
        layers.append(ta)
        hf = {**ta["hf"], "_given": False}
        ds_sources.append((RECIPES[recipe]["deepspeed"], f"recipe {recipe} (DeepSpeed)"))
    if launched is not None:
        layers += launched.layers
        hf = {**launched.hf, "_given": False}
        if launched.deepspeed is not None:
            ds_sources.append((launched.deepspeed, launched.deepspeed_where))
        elif any(layer["parallel"].get("strategy") == "fsdp" for layer in launched.layers):
            ds_sources.clear()  # the launcher's FSDP replaces the recipe's DeepSpeed config
    if training_args is not None:
        ta = from_training_args(training_args)
        layers.append(ta)
        hf = ta["hf"]
        if ta["deepspeed"] is not None:
            ds_sources.append((ta["deepspeed"], ta["deepspeed_where"] or "training_args.deepspeed"))
        elif ta["parallel"].get("strategy") == "fsdp":
            ds_sources.clear()  # the user's own args replace the recipe's DeepSpeed config
    if deepspeed is not None:
        if any(layer["parallel"].get("strategy") == "fsdp" for layer in layers[-1:]):
            raise SpecError("deepspeed", str(deepspeed),
                            reason="FSDP (training args) and DeepSpeed cannot both be set")
        ds_sources.append((deepspeed, None))
    if "micro_batch" in over["spec"]:
        hf = {**(hf or HF_DEFAULTS), "per_device_train_batch_size": over["spec"]["micro_batch"],
              "_given": False}
    if ds_sources:
        model = over["spec"].get("model") or (launched and launched.model)
        hidden = hidden_size_of(model) if model else None
        source, where = ds_sources[-1]
        layers.append(from_deepspeed_json(source, hidden_size=hidden, hf=hf, where=where))
    layers.append(over)
    return _combine(layers, over)


def _combine(layers: list[dict], over: dict) -> tuple[dict, dict]:
    spec: dict = {}
    parallel: dict = {}
    lora: dict = {}
    sources: dict = {}
    values: dict = {}
    multi_gpu = "ddp"
    for layer in layers:
        spec.update(layer["spec"])
        parallel.update(layer["parallel"])
        lora.update(layer["lora"])
        multi_gpu = layer.get("multi_gpu_strategy", multi_gpu)
        said = layer.get("sources", {})
        for key, value in layer_values(layer).items():
            if key in said:
                sources[key] = said[key]
            elif values.get(key, object()) != value or key not in sources:
                sources[key] = layer.get("label", "?")
            values[key] = value
    if parallel.get("strategy") == "fsdp" and any(
            layer["parallel"].get("strategy", "").startswith("zero") for layer in layers):
        if "strategy" not in over["parallel"]:
            raise SpecError("parallel.strategy", "fsdp+zero",
                            reason="FSDP and DeepSpeed ZeRO cannot both be set")
    ws = parallel.get("world_size", 1)
    # the data-parallel ranks: what the model-parallel axes leave (job.parallel.ParallelSpec)
    model = 1
    for axis in ("tp", "cp", "pp", "dp_replicate"):
        model *= parallel.get(axis, 1) if isinstance(parallel.get(axis, 1), int) else 1
    dp = parallel.get("dp_shard") or (ws // model if model else ws)
    if parallel.get("strategy", "none") == "none" and dp * parallel.get("dp_replicate", 1) > 1:
        # torchrun + HF Trainer without DeepSpeed/FSDP is DDP; a launcher's multi-GPU recipe
        # may say otherwise (torchtune's distributed recipes shard with FSDP2)
        parallel["strategy"] = multi_gpu
        sources["strategy"] = (f"{sources.get('world_size', 'world_size')}: "
                               f"{multi_gpu} across {ws} GPUs")
    if "precision" in spec and "precision" not in over["spec"]:
        ran = deepspeed_precision(str(parallel.get("strategy", "")), spec["precision"])
        if ran != spec["precision"]:
            sources["precision"] = f"{sources.get('precision', '?')} under DeepSpeed ZeRO"
        spec["precision"] = ran
    axes = [key for key in schema.AXIS_KEYS if over["spec"].get(key) is not None]
    if axes:  # precision axes given as flags override the shorthand (job.precision.fold)
        given = ", ".join(flag_source(key) for key in axes)
        sources["precision"] = given + (f" over {sources['precision']}"
                                        if "precision" in sources else "")
    if spec.get("train") == "lora":
        spec["lora"] = LoraSpec(**lora)
    elif over["lora"]:
        raise SpecError("train", spec.get("train", "full"), ["lora"],
                        reason="--lora-* options need --train lora")
    spec["parallel"] = ParallelSpec(**parallel)
    return spec, sources


def _non_default(spec: TrainingSpec, sources: dict) -> dict:
    """The sources of the fields `spec` does not leave at the schema default (and the model)."""
    job = schema.job_dict(spec)
    out = {}
    for meta in schema.FIELDS:
        if meta.key not in sources:
            continue
        if meta.owner == "lora":
            value = None if job["lora"] is None else job["lora"][meta.name]
            if value is None:
                continue
        else:
            value = job[meta.name]
        default = list(meta.default) if isinstance(meta.default, tuple) else meta.default
        if meta.name == "model" or value != default:
            out[meta.key] = sources[meta.key]
    return out


def spec_from_inputs(recipe: str | None = None, deepspeed: str | os.PathLike | dict | None = None,
                     training_args: str | os.PathLike | dict | None = None,
                     overrides: dict | None = None) -> TrainingSpec:
    """`resolve_inputs`' TrainingSpec (parallel settings checked against the rest)."""
    return resolve_inputs(recipe, deepspeed, training_args, overrides).spec
