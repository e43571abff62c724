"""What the launcher readers share: the YAML file, the layer they build, the model key, a
DeepSpeed path, the HF TrainingArguments field names.

A reader returns a `LauncherConfig`: one layer in `merge_inputs`' form (spec / parallel / lora
fields, each with its source: "FILE: key", or "launcher default (NAME)" for a value the
launcher picks when the file is silent), the values that resolve a DeepSpeed "auto", and the
DeepSpeed config the file names.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from hybridmem.errors import SpecError
from hybridmem.jsonfile import check_depth, read_json_text
from hybridmem.job import schema
from hybridmem.models import hub
from hybridmem.intake import library_fields


@dataclass
class LauncherConfig:
    """A launcher's config file read as the launcher reads it."""

    dialect: str
    """Its launcher, as the sources name it ("LLaMA-Factory", "axolotl", "torchtune")."""
    model: str | None
    """The model the file names: a preset (a hub id resolved) or a config path."""
    layers: list[dict]
    """Layers in `merge_inputs`' form, lowest first."""
    hf: dict
    """TrainingArguments-like values that resolve DeepSpeed "auto" keys
    (`readers.deepspeed.from_deepspeed_json`)."""
    deepspeed: dict | None = None
    deepspeed_where: str | None = None


class Layer:
    """One `merge_inputs` layer with the source of each field it sets."""

    def __init__(self, where: str, dialect: str):
        self.where = where
        self.default = f"launcher default ({dialect})"
        self.data: dict = {"spec": {}, "parallel": {}, "lora": {}, "sources": {}, "label": where}

    def set(self, key: str, value: object, *file_keys: str, note: str = "") -> None:
        """Field `key` (a job-schema key) = `value`, read from `file_keys` of the file (none:
        the launcher's default); `note` is added to the source, e.g. the hub id."""
        meta = schema.BY_KEY[key]
        self.data[meta.owner][meta.name] = value
        if key == "model" and note:  # the hub id, whose config.json may hold quantisation
            self.data["hub_id"] = note
        text = f"{self.where}: {'/'.join(file_keys)}" if file_keys else self.default
        self.data["sources"][key] = text + (f" ({note})" if note else "")

    def merge(self, other: dict) -> None:
        """Take the fields (and their sources) of a layer built by another reader."""
        for part in ("spec", "parallel", "lora", "sources"):
            self.data[part].update(other.get(part, {}))


MAX_CONFIG_CHARS = 1 << 20
"""Longest launcher config read: the LLaMA-Factory, axolotl, torchtune and torchtitan example
configs are a few KB; PyYAML took over 2 minutes on an 8 MB flow sequence on the 2-core
development machine."""


def read_config_text(path: str | os.PathLike) -> str:
    """The text of a launcher config file (YAML, TOML, a launch script), or one line naming it:
    missing, unreadable, not UTF-8, or longer than `MAX_CONFIG_CHARS`."""
    text = read_json_text(path, "config")  # the same one-line errors as every JSON input
    if len(text) > MAX_CONFIG_CHARS:
        raise SpecError("config", os.fspath(path), reason=f"{len(text)} characters: a launcher "
                        f"config is at most {MAX_CONFIG_CHARS} here")
    return text


def load_yaml(path: str | os.PathLike) -> dict:
    """The YAML mapping of a config file; a missing or malformed file is one line naming it."""
    return parse_yaml(read_config_text(path), os.fspath(path))


def parse_yaml(text: str, where: str) -> dict:
    """The YAML mapping of a config's text (`where` names it in errors)."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1} col {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecError("config", where, reason=f"malformed YAML{at}: {problem}") from None
    except RecursionError:  # PyYAML's composer recurses once per nesting level
        raise SpecError("config", where, reason="YAML nested too deeply") from None
    check_depth(data, "config", where)
    if not isinstance(data, dict):
        raise SpecError("config", where, reason="must be a YAML mapping of keys to values")
    return data


def model_of(value: object, where: str, key: str,
             override: str | None = None) -> tuple[str, str]:
    """(preset or path, hub id note) of the file's model key: a hub id becomes its preset
    (`hybridmem.models.hub`; an unknown one is a one-line error), a path stays a path.
    `override`: the `--model` flag's model, which the launcher rules then read instead (flags
    override the file, its model too)."""
    if override is not None:
        value = override
    if not isinstance(value, str) or not value.strip():
        raise SpecError(f"{where}: {key}", value, reason="names no model")
    preset = hub.resolve(value)
    return preset, (value if preset != value else "")


def local_file(value: object, folder: Path) -> object:
    """A path the launcher opens from its working directory; when that does not exist here,
    the same path beside the config file (an inline object stays as it is)."""
    if not isinstance(value, (str, os.PathLike)):
        return value
    path = Path(value).expanduser()
    if path.is_absolute() or path.exists() or not (folder / path).exists():
        return os.fspath(value)
    return os.fspath(folder / path)


@lru_cache(maxsize=1)
def hf_training_fields() -> frozenset[str]:
    """Field names of the installed transformers' `Seq2SeqTrainingArguments`: the
    TrainingArguments LLaMA-Factory's own extends (hparams/training_args.py), read from its
    source (`library_fields`: without importing transformers and torch)."""
    names = library_fields.class_fields("transformers.training_args_seq2seq",
                                        "Seq2SeqTrainingArguments")
    if names is not None:
        return names
    from transformers import Seq2SeqTrainingArguments

    return frozenset(f.name for f in dataclasses.fields(Seq2SeqTrainingArguments))


def model_data(model: str) -> dict:
    """The model's config.json (a preset's or a path's), for the launcher rules that depend on
    the model: multimodal or not, its torch_dtype."""
    from hybridmem.models.loader import load_config_dict

    return load_config_dict(model)[1]


def is_multimodal(model: str) -> bool:
    """Whether the model takes images (a VLM family, or a config with a vision_config)."""
    from hybridmem.models.loader import is_multimodal as family_vlm, validate_types

    data = model_data(model)
    return family_vlm(validate_types(data))


def torch_dtype_of(model: str) -> str | None:
    """The config.json's `torch_dtype` (transformers 5.x writes `dtype`), or None."""
    data = model_data(model)
    text = data.get("torch_dtype") or data.get("dtype") or (
        data.get("text_config") or {}).get("torch_dtype")
    return None if text is None else str(text).removeprefix("torch.")


def names(value: object, where: str) -> tuple[str, ...]:
    """A comma-separated string or a list of module names, as the launchers take them."""
    if isinstance(value, str):
        return tuple(t.strip() for t in value.split(",") if t.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value):
        return tuple(value)
    raise SpecError(where, value, reason="must be a comma-separated string or a list of names")


def flag(where: str, value: object) -> bool:
    """A YAML boolean (the launchers' parsers take true/false, and omegaconf's strings)."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise SpecError(where, value, [True, False])
    return value
