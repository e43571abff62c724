"""How a job field is declared: `job_field(...)`, a dataclass field carrying a `JobField`.

Each field of `TrainingSpec`, `LoraSpec` and `ParallelSpec` is declared once with everything
the front doors need (help, group, choices, CLI names, config keys, dataset column, learned
feature); `hybridmem.job.schema` reads the declarations back and generates the CLI options, the
config readers' key maps, the `job` JSON, the README options table and the dataset columns.
This module imports nothing from the package but `hybridmem.errors`, so the spec modules can
use it (docs/design.md, "Job schema").
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any

from hybridmem.errors import SpecError

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


UNIT_MAXIMA: dict[str, int] = {
    "samples": 1 << 16,   # per-GPU micro-batch: the micro-batch search's own ceiling
    "tokens": 1 << 24,    # 16.8M: above the longest context a model ships (Llama 4 Scout, 10M)
    "GPUs": 1 << 20,      # 1M: ~5x the largest training cluster reported (~200k GPUs)
    "steps": 1 << 24,     # 16.8M optimizer steps: ~15x Llama 3 405B's run (15.6T tokens / 16M)
    "elements": 1 << 44,  # 17.6T: ~9x the largest published parameter count (~2T)
    "images": 1 << 12,    # 4096 images (or video frames) in one sample
    "pixels": 1 << 15,    # 32768 px a side: the processors resize far below this
    "chunks": 1 << 24,    # a chunk per token at the longest sequence
    "sequences": 1 << 16,  # GRPO completions per prompt: as many as a micro-batch holds
    "micro-batches": 1 << 20,  # per pipeline step: a global batch of 1M micro-batches
    "MiB": 1 << 30,       # 1 PiB of buffer
}
"""Upper bound of a numeric field per unit, for fields that do not declare their own: values no
real job reaches, so a value above one is a typo or an attack, refused before any work (a
micro-batch of 10**20 would otherwise keep a core busy for minutes). A new field with one of
these units is bounded with no more said; tests/test_bounds.py asserts every integer field has
a bound."""


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
    maximum: int | float | None = None
    """Largest value a real job could have (the explicit one, else `UNIT_MAXIMA[unit]`);
    `check_bounds` refuses more before any work, in the CLI and the API alike."""
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
              feature: bool = False, added: int | None = None, echo: bool = False,
              maximum: int | float | None = None) -> Any:
    """A dataclass field declared with its `JobField` (see its attributes); `maximum`:
    the bound, where the unit's (`UNIT_MAXIMA`) does not fit or there is no unit."""
    if group not in GROUPS:
        raise ValueError(f"group {group!r} is not one of {list(GROUPS)}")
    unknown = set(keys or {}) - set(SOURCES)
    if unknown:
        raise ValueError(f"config sources {sorted(unknown)} are not among {SOURCES}")
    meta = JobField(help=help, group=group, default=default, choices=choices, unit=unit,
                    cli_wanted=cli, doc=doc,
                    keys={s: tuple(k) for s, k in (keys or {}).items()},
                    recorded=recorded, feature=feature, added=added, echo=echo,
                    maximum=UNIT_MAXIMA.get(unit) if maximum is None else maximum)
    return dataclasses.field(default=default, metadata={"job": meta})


def shown(value: object) -> object:
    """`value` as an error shows it: an integer of more than 24 digits by its head and length
    (10**400 would fill a screen)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**24:
        text = str(value)
        return f"{text[:8]}...({len(text.lstrip('-'))} digits)"
    return value


def check_bounds(obj: object, prefix: str = "") -> None:
    """`check_value` for each declared field of dataclass `obj`. Called first in the specs'
    `__post_init__`, so no tier, search or reader runs on an unbounded value."""
    for f, meta in declared(type(obj)):
        check_value(meta, getattr(obj, f.name), prefix + f.name)


def check_value(meta: JobField, value: object, name: str) -> None:
    """Refuse a number above the field's `maximum`, or a float that is not finite, with the
    one-line error naming the field, the value and the bound; anything else is left to the
    spec's own checks."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and not -float("inf") < value < float("inf"):
        raise SpecError(name, value, reason="must be a finite number")
    if meta.maximum is not None and value > meta.maximum:
        unit = f" {meta.unit}" if meta.unit else ""
        raise SpecError(name, shown(value), reason=f"above {meta.maximum}{unit}, more than a "
                        "real job has (the field's bound in the job schema)")


def declared(cls) -> list[tuple[dataclasses.Field, JobField]]:
    """The fields of dataclass `cls` declared with `job_field`, in order."""
    return [(f, f.metadata["job"]) for f in dataclasses.fields(cls) if "job" in f.metadata]


def added_defaults(*classes) -> dict[str, object]:
    """name -> default of the `added` fields of `classes`, in the order they were added."""
    marked = [(meta.added, f.name, f.default) for cls in classes for f, meta in declared(cls)
              if meta.added is not None]
    return {name: default for _, name, default in sorted(marked)}
