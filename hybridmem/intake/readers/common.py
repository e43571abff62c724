"""What every library-config reader shares: reading a JSON file or object, naming where each
field came from, the schema's key maps and the readers' own conversions, typed copies.

Why apart: the TrainingArguments, DeepSpeed, PEFT and BitsAndBytes readers each read their own
file; the rules of how a file's key becomes a job field (and how its source is named) are one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from hybridmem.errors import SpecError
from hybridmem.job import schema
from hybridmem.jsonfile import read_json_object


def read_json(source: str | os.PathLike | dict, field: str) -> dict:
    """A config file's JSON object, or a private deep copy of one given as a dict."""
    if isinstance(source, dict):
        return json.loads(json.dumps(source))  # a private deep copy
    return read_json_object(source, field)


def key_where(source: object, default: str) -> str:
    """How a warning names the file: its path, else what it came from."""
    return default if isinstance(source, dict) else os.fspath(source)


OWNER_PARTS: tuple[str, ...] = ("spec", "parallel", "lora")


def flat_key(owner: str, name: str) -> str:
    """The job-schema key of a layer entry: LoRA settings are `lora_<name>`."""
    return f"lora_{name}" if owner == "lora" else name


def layer_values(layer: dict) -> dict:
    """flat key -> value of every field a layer sets."""
    return {flat_key(o, n): v for o in OWNER_PARTS for n, v in layer.get(o, {}).items()}


def attribute(out: dict, before: dict, before_sources: dict, where: str, given: list[str],
              source: str, default: str) -> None:
    """Name the source of every field of layer `out` that changed since `before`
    (`layer_values`) and whose source was not set meanwhile: "WHERE: key" with the `given` file
    keys the schema declares for that field under `source` (all of `given` when it declares
    none of them), else `default` (the reader's default, no key given)."""
    sources = out.setdefault("sources", {})
    for key, value in layer_values(out).items():
        if (key in before and before[key] == value) \
                or sources.get(key) != before_sources.get(key):
            continue
        meta = schema.BY_KEY.get(key)
        own = [k for k in given if meta is not None and k in meta.keys.get(source, ())]
        keys = own or given
        sources[key] = f"{where}: {'/'.join(keys)}" if keys else default


def file_source(where: str, source: str, key: str, data: dict) -> str:
    """"WHERE: key" for a field read from a `source` file: the file keys the schema declares
    for it that the file holds (`schema.config_keys`)."""
    meta = schema.BY_KEY.get(key)
    keys = [k for k in (meta.keys.get(source, ()) if meta else ()) if k in data]
    return f"{where}: {'/'.join(keys)}" if keys else where


def whole_count(field: str, value: object) -> int:
    """DeepSpeed numbers may be written 1e9; they must be whole and non-negative."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
            or int(value) != value:
        raise SpecError(field, value, reason="must be a non-negative whole number")
    return int(value)


def clip_norm(field: str, value: object) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise SpecError(field, value, reason="must be a number >= 0 (0 = no clipping)")
    return float(value)


def flag_value(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise SpecError(field, value, [True, False])
    return value


# ---------------------------------------------------------------- key maps from the schema

@dataclass(frozen=True)
class Conversion:
    """A reader's own conversion of some config keys into job fields (keys that need more
    than a copy: a flag that picks a policy, an "auto", a name map)."""

    reads: tuple[str, ...]
    fn: Callable[[dict, dict], None]
    """fn(config, out): reads `reads` from the config, writes out["spec" | "parallel" |
    "lora"] (and out["deepspeed"], a nested DeepSpeed config)."""


CONVERSIONS: dict[str, list[Conversion]] = {"training_args": [], "deepspeed": []}
"""Per source, in the order they apply (a later one wins on the same field)."""


def converts(source: str, *reads: str):
    """Register the decorated `fn(config, out)` as the conversion of `reads` keys of `source`;
    each key must be declared on the fields it sets (tests/test_job_schema.py checks)."""
    def register(fn):
        CONVERSIONS[source].append(Conversion(reads, fn))
        return fn
    return register


def used_keys(source: str) -> set[str]:
    """Keys of `source` the readers use: declared on a job field or read by a conversion."""
    return set(schema.config_keys(source)) | {
        k for c in CONVERSIONS.get(source, ()) for k in c.reads}


def typed_value(field: str, meta, value: object) -> object:
    """A copied config value checked as the field's type, the error naming the file's key."""
    tp = schema.value_type(schema.TYPES[meta.key])
    if tp is bool:
        return flag_value(field, value)
    if tp is int:
        return whole_count(field, value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise SpecError(field, value, reason="must be a number >= 0")
        return float(value)
    return value


def copy_declared(source: str, cfg: dict, out: dict) -> None:
    """Copy every declared top-level key of `source` that no conversion reads onto its fields,
    in declaration order; a missing or null key sets nothing."""
    claimed = {k for c in CONVERSIONS[source] for k in c.reads}
    for key, metas in schema.config_keys(source).items():
        if key in claimed or "." in key or cfg.get(key) is None:
            continue
        for meta in metas:
            out[meta.owner][meta.name] = typed_value(f"{source}.{key}", meta, cfg[key])
            out.setdefault("sources", {})[meta.key] = f"{out.get('where', source)}: {key}"
