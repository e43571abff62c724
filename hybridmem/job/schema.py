"""The job schema: every job field once, read back from the spec dataclasses' declarations.

`TrainingSpec`, `LoraSpec` and `ParallelSpec` declare each field with `job_field`
(`hybridmem.job.field`); this module turns the declarations into the views the front doors
use: `FIELDS` (flat, in spec order), the `job` object of `--json` (`job_dict`, and its inverse
`spec_from_job` for the HTTP API), the config keys per source, the option help and the
console's job echo. Imports neither torch nor transformers (docs/design.md, "Job schema").
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import MISSING
from typing import Literal, get_args, get_origin

from hybridmem.errors import SpecError
from hybridmem.job.field import GROUPS, JobField, declared
from hybridmem.job.parallel import ParallelSpec
from hybridmem.job.precision import AXES, in_words
from hybridmem.job.spec import LoraSpec, TrainingSpec

OWNERS: dict[str, type] = {"spec": TrainingSpec, "lora": LoraSpec, "parallel": ParallelSpec}
NESTED: dict[str, str] = {"lora": "lora", "parallel": "parallel"}
"""TrainingSpec fields that hold a nested spec -> the owner name of its fields."""


def _cli_names(meta: JobField, key: str, is_bool: bool) -> tuple[str, ...]:
    wanted = meta.cli_wanted
    if wanted is False:
        return ()
    if isinstance(wanted, str):
        wanted = (wanted,)
    if wanted is True:
        flag = "--" + key.replace("_", "-")
        wanted = (f"{flag}/--no-{flag[2:]}",) if is_bool else (flag,)
    return tuple(wanted)


def _place(owner: str, f: dataclasses.Field, meta: JobField, hints: dict) -> JobField:
    """The declaration with its name, owner, flat key, choices and CLI names filled in."""
    key = f"lora_{f.name}" if owner == "lora" else f.name
    tp = hints[f.name]
    choices = meta.choices
    if choices is None and get_origin(tp) is Literal:
        choices = get_args(tp)
    return dataclasses.replace(meta, name=f.name, owner=owner, key=key, choices=choices,
                               cli=_cli_names(meta, key, value_type(tp) is bool))


def value_type(tp: object) -> type:
    """The plain type a field's value is given as on a command line: bool, int, float or str
    (a Literal, a union with str, a tuple: str)."""
    args = [a for a in get_args(tp) if a is not type(None)] \
        if get_origin(tp) in (typing.Union, types.UnionType) else [tp]
    if len(args) == 1 and args[0] in (bool, int, float):
        return args[0]
    return str


def _collect() -> tuple[tuple[JobField, ...], dict[str, object]]:
    hints = {o: typing.get_type_hints(cls) for o, cls in OWNERS.items()}
    out: list[JobField] = []
    for f in dataclasses.fields(TrainingSpec):
        if f.name in NESTED:
            owner = NESTED[f.name]
            out += [_place(owner, g, meta, hints[owner]) for g, meta in declared(OWNERS[owner])]
        elif "job" in f.metadata:
            out.append(_place("spec", f, f.metadata["job"], hints["spec"]))
    types_ = {m.key: hints[m.owner][m.name] for m in out}
    return tuple(out), types_


FIELDS, TYPES = _collect()
"""Every job field, flat in spec order (LoRA's and ParallelSpec's where the spec holds them);
`TYPES`: flat key -> the field's annotation."""
BY_KEY: dict[str, JobField] = {m.key: m for m in FIELDS}
CLI_FIELDS: tuple[JobField, ...] = tuple(m for m in FIELDS if m.cli)


def by_group() -> dict[str, list[JobField]]:
    """`GROUPS` order -> the fields of each group, in spec order."""
    out: dict[str, list[JobField]] = {g: [] for g in GROUPS}
    for m in FIELDS:
        out[m.group].append(m)
    return out


def recorded_fields() -> list[JobField]:
    """The dataset's added columns: the `recorded` fields in the order they were added."""
    return sorted((m for m in FIELDS if m.recorded), key=lambda m: m.added)


def feature_fields() -> list[JobField]:
    """Fields whose value is a learned-tier feature of the same name."""
    return [m for m in FIELDS if m.feature]


def feature_values(spec: TrainingSpec) -> dict[str, object]:
    """The job's own learned-tier features: each `feature` field's value under its flat key,
    a bool as 0/1 (features derived with the model config are `hybridmem.learned.features`')."""
    holders = {"spec": spec, "lora": spec.lora, "parallel": spec.parallel}
    out: dict[str, object] = {}
    for meta in feature_fields():
        value = getattr(holders[meta.owner], meta.name)
        out[meta.key] = int(value) if isinstance(value, bool) else value
    return out


def config_keys(source: str) -> dict[str, list[JobField]]:
    """Config key of `source` (field.SOURCES) -> the fields it sets, in declaration order."""
    out: dict[str, list[JobField]] = {}
    for m in FIELDS:
        for key in m.keys.get(source, ()):
            out.setdefault(key, []).append(m)
    return out


def parse_cli(meta: JobField, value: object) -> object:
    """A command-line (or override) value as the field takes it: a comma list or a list
    becomes a tuple for a tuple field; anything else is left to the spec's checks."""
    if "tuple" not in str(TYPES[meta.key]):
        return value
    if isinstance(value, str):
        return tuple(t.strip() for t in value.split(",") if t.strip())
    return tuple(value) if isinstance(value, list) else value


def default_text(meta: JobField) -> str:
    """The default as a user would type it ('' when required or None)."""
    d = meta.default
    if d is MISSING or d is None:
        return ""
    if isinstance(d, bool):
        return "on" if d else "off"
    if isinstance(d, tuple):
        return ",".join(d) if d else ""
    return str(d)


def option_help(meta: JobField) -> str:
    """`--help` text: the one line, the choices, the default and the bound."""
    parts = [meta.help]
    if meta.choices:
        parts.append("One of: " + ", ".join(map(str, meta.choices)) + ".")
    default = default_text(meta)
    if default:
        parts.append(f"Default: {default}.")
    if meta.maximum is not None:  # the schema's bound (docs/serve.md), refused above
        parts.append(f"At most {meta.maximum}.")
    return " ".join(parts)


# ---------------------------------------------------------------- the `job` object

def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def job_dict(spec: TrainingSpec) -> dict:
    """The resolved job with the schema's names, flat: every TrainingSpec field, `lora` as a
    dict (or None), the ParallelSpec fields at the top level. JSON-ready."""
    out: dict = {}
    for f in dataclasses.fields(TrainingSpec):
        value = getattr(spec, f.name)
        if f.name == "parallel":
            out.update({g.name: _plain(getattr(value, g.name)) for g in dataclasses.fields(value)})
        elif f.name == "lora":
            out["lora"] = None if value is None else {
                g.name: _plain(getattr(value, g.name)) for g in dataclasses.fields(value)}
        else:
            out[f.name] = _plain(value)
    if spec.precision is not None:  # the shorthand's axes (job.precision.AXES), by name
        axes = AXES[spec.precision]
        out.update(weights_dtype=axes.weights_dtype, autocast=axes.autocast,
                   master_weights=axes.master_weights)
    return out


JOB_EXTRAS: tuple[str, ...] = ("warnings", "sources", "defaults")
"""Keys the `job` object may carry besides fields (the config readers' warnings; `sources`:
flat key -> where each non-default field came from, `hybridmem.intake.merge.Resolved`; the
defaults the model decided, field -> why: `hybridmem.families.defaults`); ignored by
`spec_from_job`."""


def _tuples(cls: type, data: dict) -> dict:
    hints = typing.get_type_hints(cls)
    return {k: tuple(v) if isinstance(v, list) and "tuple" in str(hints[k]) else v
            for k, v in data.items()}


def spec_from_job(job: dict) -> TrainingSpec:
    """Inverse of `job_dict`: a validated TrainingSpec; an unknown key is a SpecError naming it
    and the valid names. Parallel settings are checked against the rest of the job by
    `hybridmem.parallel.validate.check_parallel`, as `spec_from_inputs` does."""
    if not isinstance(job, dict):
        raise SpecError("job", type(job).__name__, reason="must be a JSON object")
    spec_names = [f.name for f in dataclasses.fields(TrainingSpec) if f.name != "parallel"]
    par_names = [f.name for f in dataclasses.fields(ParallelSpec)]
    valid = [*spec_names, *par_names]
    unknown = [k for k in job if k not in valid and k not in JOB_EXTRAS]
    if unknown:
        raise SpecError("job", unknown[0], valid, reason="unknown field")
    spec = {k: v for k, v in job.items() if k in spec_names}
    par = {k: v for k, v in job.items() if k in par_names}
    lora = spec.pop("lora", None)
    if lora is not None:
        if not isinstance(lora, dict):
            raise SpecError("job.lora", lora, reason="must be an object or null")
        lora_names = [f.name for f in dataclasses.fields(LoraSpec)]
        bad = [k for k in lora if k not in lora_names]
        if bad:
            raise SpecError("job.lora", bad[0], lora_names, reason="unknown field")
        spec["lora"] = LoraSpec(**_tuples(LoraSpec, lora))
    return TrainingSpec(**_tuples(TrainingSpec, spec), parallel=ParallelSpec(**par))


# ---------------------------------------------------------------- the console's job echo

def _value(meta: JobField, job: dict) -> object:
    if meta.owner == "lora":
        return None if job.get("lora") is None else job["lora"][meta.name]
    return job[meta.name]


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    text = str(value)
    return text if len(text) <= ECHO_WIDTH else text[:ECHO_WIDTH - 3] + "..."


AXIS_KEYS: tuple[str, ...] = ("weights_dtype", "autocast", "master_weights")
"""Precision axes the echo says in words (`in_words`) rather than as fields."""

ECHO_WIDTH = 48
"""Longest value the echo shows whole (a PEFT config's JSON is cut)."""


def _source_note(source: str | None, flags: bool) -> str:
    """" (train.yaml: cutoff_len)" for a field's source as the echo shows it: a file by its
    name, a launcher's default as "NAME default"; flags only when `flags` (a file is in play,
    so a bare value could be either)."""
    if source is None or (source.startswith("flag ") and not flags):
        return ""
    if source.startswith("launcher default (") and ")" in source:
        name, _, rest = source[len("launcher default ("):].partition(")")
        source = f"{name} default" + (f": {rest.strip()[1:-1]}" if rest.strip() else "")
    head, sep, tail = source.partition(": ")
    if sep and ("/" in head or "\\" in head):
        source = head.replace("\\", "/").rsplit("/", 1)[-1] + sep + tail
    return f" ({source})"


def echo_lines(job: dict) -> list[str]:
    """The job as priced, one line per group: the `echo` fields always, the others when they
    are not at their default (LoRA settings only when training LoRA), e.g.
    `model: llava-1.5-7b attn=sdpa` / `batch: micro_batch=8 seq_len=2048 grad_accum=1`; a
    field with a recorded source says it, `micro_batch=4 (train.yaml:
    per_device_train_batch_size)` (flags only beside a file)."""
    sources = job.get("sources") or {}
    flags = any(not s.startswith("flag ") for s in sources.values())
    lines = []
    for group, metas in by_group().items():
        parts = []
        for meta in metas:
            if meta.owner == "lora" and job.get("lora") is None:
                continue
            if meta.key in AXIS_KEYS and job.get("precision") is not None:
                continue  # said in words below
            value = _value(meta, job)
            note = _source_note(sources.get(meta.key), flags)
            if meta.name == "model":
                parts.append(_shown(value) + note)
            elif meta.echo or value != _plain(meta.default) \
                    or meta.owner == "lora" and meta.name in ("r", "alpha"):
                parts.append(f"{meta.key}={_shown(value)}{note}")
        if group == "precision" and job.get("precision") is not None:
            # the axes in words (job.precision.in_words): what `--precision` means here
            parts.append("(" + in_words(job["precision"], job["train"], job["strategy"],
                                        job["mp_param_dtype"], job["mp_reduce_dtype"],
                                        job.get("adapter_dtype")) + ")")
        if parts:
            lines.append(f"{group}: " + " ".join(parts))
    for name, why in (job.get("defaults") or {}).items():  # what the model decided, and why
        if (name, job[name]) != ("attn", "sdpa"):  # sdpa: transformers' usual pick, unsaid
            lines.append(f"default {name}={job[name]}: {why}")
    return lines
