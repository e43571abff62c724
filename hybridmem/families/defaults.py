"""The defaults that follow the model: attention implementation and precision, one rule each.

Why here: both depend on the model (its transformers code, its checkpoint's `torch_dtype`), which
the job layer cannot read. `intake.resolve.resolve_once` applies `resolve_defaults` once per job
and hands the typed `Job` on; a tier's Python entry given a plain spec (a script, a test) takes
it through `as_job`, which returns a `Job` as it is. A value the user gave (`--attn`,
`--precision`, a config file's key) is never touched.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmem.families import NO_SDPA, family
from hybridmem.job.resolved import Job
from hybridmem.job.spec import TrainingSpec
from hybridmem.models.loader import load_config_dict, validate_types

ADAPTER_TRAINS = ("lora", "peft")
"""Trainables whose base weights stay frozen in the dtype the model was loaded with."""

# The checkpoint dtype as the model is loaded: transformers 5 `from_pretrained(dtype="auto")`
# (its default) reads config.json's `dtype` / `torch_dtype`; absent, float32
# (PreTrainedModel._get_dtype). peft then keeps adapters fp32 (`autocast_adapter_dtype=True`).
LOADED_PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

FULL_DEFAULT = "bf16-mixed"
"""Full fine-tuning without a precision given: fp32 weights + bf16 autocast, as Trainer runs
`bf16=True` on a model loaded in fp32 (torch.amp keeps fp32 params, docs "Automatic Mixed
Precision"): the setting the HF fine-tuning scripts and most recipes use."""


@dataclass(frozen=True, slots=True)
class Resolved:
    """The spec with its model-dependent defaults filled in, and what was filled in and why."""

    spec: Job
    defaults: dict[str, str]
    """field -> the one-line reason for the value taken (empty when the user gave both)."""


def checkpoint_dtype(data: dict) -> str | None:
    """config.json's dtype (`dtype` in transformers 5 files, `torch_dtype` before), the top
    level first, else the text model's (VLM configs carry it there too)."""
    for d in (data, data.get("text_config") or {}):
        value = d.get("dtype") or d.get("torch_dtype")
        if isinstance(value, str):
            return value.removeprefix("torch.")
    return None


def default_attn(model_type: str) -> tuple[str, str]:
    """What transformers picks with no `attn_implementation`: `sdpa`, falling back to `eager`
    where the model class cannot dispatch SDPA (PreTrainedModel.get_correct_attn_implementation:
    `_sdpa_can_dispatch` fails when `_supports_sdpa` is False)."""
    from hybridmem.families.attention import declared

    fam = family(model_type)
    found = declared(model_type, fam.kind) if fam is not None else None
    if found is not None:  # the installed transformers' class (families/attention.py)
        supports = found[1]["sdpa"]
    elif fam is not None:
        supports = not fam.has(NO_SDPA)
    else:
        supports = _transformers_supports_sdpa(model_type)
    if supports:
        return "sdpa", "transformers' default"
    return "eager", (f"transformers' {model_type} code has no SDPA path "
                     "(_supports_sdpa = False), so it picks eager")


def _transformers_supports_sdpa(model_type: str) -> bool:
    """`_supports_sdpa` of the class the trace tier builds (only for the trace-only families,
    which import transformers anyway)."""
    from transformers.models.auto import modeling_auto as auto

    import transformers
    for names in (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                  auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        if model_type in names:
            cls = getattr(transformers, names[model_type], None)
            return bool(getattr(cls, "_supports_sdpa", True))
    return True


def default_precision(train: str, dtype: str | None) -> tuple[str, str]:
    """Adapters (LoRA, peft): the base stays in the dtype it is loaded with (the checkpoint's,
    transformers 5 `dtype="auto"`), compute in that dtype, adapters fp32 (peft). Full / partial
    fine-tuning: `bf16-mixed` (FULL_DEFAULT)."""
    if train in ADAPTER_TRAINS:
        name = LOADED_PRECISION.get(dtype or "float32", "fp32")
        return name, (f"{train}: base weights as loaded, config.json dtype "
                      f"{dtype or 'absent (float32)'}; adapters fp32 (peft)")
    return FULL_DEFAULT, f"{train} fine-tuning: fp32 weights + bf16 autocast (Trainer bf16=True)"


def resolve_defaults(spec: TrainingSpec) -> Resolved:
    """`spec` with `attn` and `precision` filled in where the user left them None."""
    if spec.attn is not None and spec.precision is not None:
        return Resolved(Job.of(spec), {})
    _, data = load_config_dict(spec.model)
    model_type = validate_types(data)
    changes: dict[str, str] = {}
    why: dict[str, str] = {}
    if spec.attn is None:
        changes["attn"], why["attn"] = default_attn(model_type)
    if spec.precision is None:
        changes["precision"], why["precision"] = default_precision(spec.train,
                                                                   checkpoint_dtype(data))
    return Resolved(Job.of(spec.with_(**changes)), why)


def as_job(spec: TrainingSpec) -> Job:
    """`spec` as a `Job`: a job as it is (every path through `intake.resolve`), a plain spec
    with its defaults filled in. Only a tier's Python entry calls it, for the scripts and tests
    that price a `TrainingSpec` directly; the code below that entry takes a `Job`."""
    return spec if isinstance(spec, Job) else resolve_defaults(spec).spec
