"""The job from everything a user gives (flags, a recipe, config files, a launcher's config),
resolved once: the model's defaults filled in and the tier chosen, each with why.

`resolve_once` is the one place both happen: the CLI, the HTTP service and `predict(spec)` call
it once per job and hand the `ResolvedJob` on; the tier's refusal rule and the learned tier's
policy are read once, on the spec with its defaults filled in.

Why its own module: the launcher dialects (`hybridmem.intake.dialects`) build on the
TrainingArguments / DeepSpeed readers (`hybridmem.intake.readers`), so what reads a `--config`
file and stacks it with the rest (`hybridmem.intake.merge`) sits above both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hybridmem import objectives
from hybridmem.batches.scope import closed_form_gap
from hybridmem.errors import SpecError
from hybridmem.families.defaults import resolve_defaults
from hybridmem.intake.merge import Resolved, resolve_inputs
from hybridmem.intake.dialects import LauncherConfig, read_config
from hybridmem.job.resolved import Job
from hybridmem.job.spec import TrainingSpec
from hybridmem.models.light import light_config
from hybridmem.models.loader import is_analytic, model_type_of
from hybridmem.tiers import TIERS, clause, no_tier, refusal

METHODS: tuple[str, ...] = ("analytic", "trace", "hybrid")
"""The tiers `--method` names."""


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
        model = (overrides or {}).get("model")  # read in place of the file's model
        launched = None if config is None else read_config(config, config_format, model)
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


@dataclass(frozen=True, slots=True)
class Choice:
    """The tier that answers a spec and why (`Prediction.extras["method_reason"]`)."""

    method: str
    reason: str
    note: str | None = None
    """Said in the answer's notes: a tier picked because the default one refuses the job."""


def choose_method(spec: TrainingSpec, method: str | None = None) -> Choice:
    """The tier for `spec`: `method` when given; else the trace tier for what only it prices
    (the analytic tier's `refusal`, and a `--lengths` run whose reserved growth the closed form
    does not price, `batches.scope.closed_form_gap`), else hybrid when a GPU-calibrated learned model for this
    environment exists (`learned.predictor.default_method`), else analytic.

    One chooser for the Python API, the CLI and the service, called by `resolve_once` on the
    spec with its defaults filled in. A job no tier prices is a `SpecError` naming each tier's
    refusal."""
    if method is not None:
        if method not in METHODS:
            raise SpecError("method", method, METHODS)
        return Choice(method, f"method={method!r} given")
    refused = refusal("analytic", spec)
    if refused is not None:
        if refusal("trace", spec) is not None:
            raise no_tier(refused, spec, "analytic")
        why = f"the analytic tier refuses {clause(refused)}"
        return Choice("trace", why,
                      note=f"method: trace chosen because {why} (pass --method to override)")
    gap = closed_form_gap(spec)  # None without --lengths: the trace tier's rule (torch) only then
    if gap is not None and refusal("trace", spec) is None:  # the hybrid tier's run uses the analytic streams too
        why = f"the closed form does not price this run's reserved growth: {gap}"
        return Choice("trace", why,
                      note=f"method: trace chosen because {why} (pass --method to override)")
    if not objectives.lm_loss(spec):  # the learned residuals were fit on SFT steps only
        return Choice("analytic", f"objective={spec.objective!r}: the learned tier is fit on "
                      "SFT steps only")
    hybrid = TIERS.get("hybrid")  # registered by `learned/tier.py` (it sits above)
    try:
        applies = hybrid is not None and hybrid.applies(spec)
    except ImportError:  # the `learned` extra is not installed
        return Choice("analytic", "the learned extra is not installed (no hybrid tier)")
    if applies:
        return Choice("hybrid", "a GPU-calibrated learned model trained on this torch applies")
    where = hybrid.models_root() if hybrid is not None else "no registry"
    return Choice("analytic", "no GPU-calibrated learned model trained on this torch and CUDA "
                  f"in {where} (the models shipped with hybridmem, or $HYBRIDMEM_MODELS)")


@dataclass(frozen=True)
class ResolvedJob:
    """One job as every tier prices it: the spec with the model's defaults filled in, where its
    fields came from, what the model decided and why, and the tier that answers and why."""

    spec: Job
    """The job every tier prices: its `attn` and `precision` decided (`job.resolved.Job`)."""
    tier: Choice
    given: TrainingSpec
    """The spec as given, before the model's defaults (the fit advice varies it and fills
    each variant's defaults again: a ZeRO variant runs a defaulted precision as ZeRO does)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Flat job-schema key -> where the value came from (`merge.Resolved.sources`)."""
    defaults: dict[str, str] = field(default_factory=dict)
    """Field -> why the model decided it (`families.defaults.resolve_defaults`)."""

    @property
    def method(self) -> str:
        return self.tier.method


def resolve_once(job: TrainingSpec | Resolved, method: str | None = None) -> ResolvedJob:
    """The job with its model checked, its defaults filled in (attention and precision left
    open follow the model) and its tier chosen: once, for every front door."""
    spec, sources = (job.spec, job.sources) if isinstance(job, Resolved) else (job, {})
    # unknown preset / bad config JSON / unknown model_type fail here, the same for every
    # tier, without importing transformers for the analytic families (that alone costs
    # seconds); a family only the trace tier prices is refused by the analytic tier's rule
    if is_analytic(model_type_of(spec.model)):
        light_config(spec.model)
    filled = resolve_defaults(spec)
    return ResolvedJob(filled.spec, choose_method(filled.spec, method), spec, sources,
                       filled.defaults)
