"""How a job field is declared: `job_field(...)`, a dataclass field carrying a `JobField`.

Each field of `TrainingSpec`, `LoraSpec` and `ParallelSpec` is declared once with everything
the front doors need (help, group, choices, CLI names, config keys, dataset column, learned
feature); `hybridmem.job.schema` reads the declarations back and generates the CLI options, the
config readers' key maps, the `job` JSON, the README options table and the dataset columns.
This module imports nothing from the package, so the spec modules can use it (docs/design.md,
"Job schema").
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any

GROUPS: dict[str, str] = {
    "model": "Model",
    "batch": "Batch and sequence",
    "adapters": "What is trained",
    "precision": "Precision, optimizer and quantised weights",
    "savers": "Memory savers",
    "loop": "Training loop",
    "objective": "Objective (preference and RL fine-tuning)",
    "parallel": "GPUs and parallelism",
}
"""Group -> help panel title, in the order the CLI help, the README table and the echo use."""

SOURCES: tuple[str, ...] = ("training_args", "deepspeed", "peft", "bnb", "torchtitan", "megatron")
"""Config files whose keys set job fields: HF TrainingArguments (and TRL SFTConfig, LLaVA's
extensions) as JSON, a DeepSpeed JSON (nested keys dotted), a PEFT adapter_config.json, a
BitsAndBytesConfig (transformers `quantization_config`), a torchtitan job TOML (`section.key`),
Megatron-LM's command-line arguments (`--name`, without the dashes)."""


@dataclass(frozen=True, slots=True)
class JobField:
    """The declaration of one job field (the dataclass field's `metadata["job"]`)."""

    help: str
    """One line for `--help` and the echo."""
    group: str
    """A `GROUPS` key."""
    default: Any = MISSING
    """The field's default (MISSING: required)."""
    choices: tuple | None = None
    """Valid values, where the field has a closed set (the Literal's, else given)."""
    unit: str | None = None
    """Unit of a number (samples, tokens, steps, MiB, elements, GPUs)."""
    cli: tuple[str, ...] = ()
    """Option declarations of `hybridmem predict` (filled from `cli=True` by the schema:
    `--name-with-dashes`, booleans `--x/--no-x`); () = no option."""
    cli_wanted: bool | str = False
    """What `job_field(cli=...)` said: True (the default name), False (none) or the names."""
    doc: str | None = None
    """Longer markdown for the README options table (else `help`)."""
    keys: dict = dataclasses.field(default_factory=dict)
    """Config keys that set the field, per `SOURCES` entry (nested keys dotted)."""
    recorded: str | None = None
    """pandas dtype when the field is a dataset column and sweep axis (`job.recorded`)."""
    feature: bool = False
    """The value (a bool as 0/1) is a learned-tier feature under the field's name."""
    added: int | None = None
    """Fields added after the dataset's first rows, numbered in the order they came: left out
    of `TrainingSpec.to_dict` at their default (so old rows keep their `spec_hash`); the
    recorded ones are the dataset's added columns in this order."""
    echo: bool = False
    """Always shown in the console's job echo (others only when not at their default)."""
    name: str = ""
    """The dataclass field's name (set by the schema)."""
    owner: str = ""
    """"spec", "lora" or "parallel": the dataclass that holds it (set by the schema)."""
    key: str = ""
    """Flat name: the field's own name, `lora_<name>` for LoRA settings (set by the schema);
    the CLI parameter and the `merge_inputs` override of the field."""


def job_field(default: Any = MISSING, *, help: str, group: str, choices: tuple | None = None,
              unit: str | None = None, cli: bool | str | tuple[str, ...] = True,
              doc: str | None = None, keys: dict | None = None, recorded: str | None = None,
              feature: bool = False, added: int | None = None, echo: bool = False) -> Any:
    """A dataclass field declared with its `JobField` (see its attributes)."""
    if group not in GROUPS:
        raise ValueError(f"group {group!r} is not one of {list(GROUPS)}")
    unknown = set(keys or {}) - set(SOURCES)
    if unknown:
        raise ValueError(f"config sources {sorted(unknown)} are not among {SOURCES}")
    meta = JobField(help=help, group=group, default=default, choices=choices, unit=unit,
                    cli_wanted=cli, doc=doc,
                    keys={s: tuple(k) for s, k in (keys or {}).items()},
                    recorded=recorded, feature=feature, added=added, echo=echo)
    return dataclasses.field(default=default, metadata={"job": meta})


def declared(cls) -> list[tuple[dataclasses.Field, JobField]]:
    """The fields of dataclass `cls` declared with `job_field`, in order."""
    return [(f, f.metadata["job"]) for f in dataclasses.fields(cls) if "job" in f.metadata]


def added_defaults(*classes) -> dict[str, object]:
    """name -> default of the `added` fields of `classes`, in the order they were added."""
    marked = [(meta.added, f.name, f.default) for cls in classes for f, meta in declared(cls)
              if meta.added is not None]
    return {name: default for _, name, default in sorted(marked)}
