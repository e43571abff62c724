"""The public Python API: `predict(spec, method=...) -> Prediction`.

Tiers are looked up by name and imported lazily, so `import hybridmem` stays fast and the
analytic tier never pays for torch-heavy tiers it does not use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module

from hybridmem import environment
from hybridmem.errors import SpecError, UnsupportedModelError
from hybridmem.gpus import GPU
from hybridmem.job.schema import job_dict
from hybridmem.models.light import light_config
from hybridmem.models.loader import is_analytic, model_type_of
from hybridmem.prediction import Prediction
from hybridmem.families.defaults import resolve_defaults
from hybridmem.job.spec import TrainingSpec

# method name -> "module:function" taking a TrainingSpec and returning a Prediction
METHODS: dict[str, str] = {
    "analytic": "hybridmem.analytic:estimate",
    "trace": "hybridmem.trace:estimate",
    "hybrid": "hybridmem.learned.predictor:estimate",
}
# the hybrid tier's own rule for whether a calibrated model applies to this environment, and
# where it looks for models (shipped with hybridmem, or $HYBRIDMEM_MODELS)
LEARNED_POLICY = "hybridmem.learned.predictor:default_method"
LEARNED_ROOT = "hybridmem.learned.registry:models_root"

PER_RANK_TIERS: frozenset[str] = frozenset({"hybrid"})
"""Tiers that price a multi-GPU spec per rank themselves: the learned tier's base is already the
per-rank analytic estimate (`learned.features.analytic_base`), and its residual was trained on
that base with the strategy among the features, so sharding its answer again would serve a
different path than `hybridmem evaluate` scores."""

# tier -> "module:function" of its `refusal(spec) -> SpecError | None`: the one rule saying
# whether that tier prices a job, kept next to the tier (torch-free for the analytic tier)
SCOPES: dict[str, str] = {
    "analytic": "hybridmem.analytic.scope:refusal",
    "trace": "hybridmem.trace.scope:refusal",
}


def refusal(method: str, spec: TrainingSpec) -> SpecError | None:
    """Why tier `method` does not price `spec`, None if it does. The hybrid tier answers with
    the trace tier where the analytic one refuses (`learned.predictor.estimate`), so it refuses
    only what both refuse."""
    if method == "hybrid":
        refused = refusal("analytic", spec)
        return refused if refused is not None and refusal("trace", spec) is not None else None
    if method not in SCOPES:
        return None
    module, func = SCOPES[method].split(":")
    return getattr(import_module(module), func)(spec)


@dataclass(frozen=True, slots=True)
class Choice:
    """The tier that answers a spec and why (`Prediction.extras["method_reason"]`)."""

    method: str
    reason: str
    note: str | None = None
    """Said in the answer's notes: a tier picked because the default one refuses the job."""


def _clause(err: SpecError) -> str:
    return f"{err.field}={err.value!r}: {err.reason}"


def no_tier(err: SpecError, spec: TrainingSpec, method: str) -> SpecError:
    """`err` (tier `method` refuses `spec`) with the way out: the first other tier whose rule
    admits the job, or that none does and why."""
    others = [m for m in SCOPES if m != method]
    for other in others:
        if refusal(other, spec) is None:
            return type(err)(err.field, err.value, err.choices,
                             reason=f"{err.reason}; use --method {other}")
    clauses = [(m, _clause(refusal(m, spec))) for m in others]
    why = "; ".join(f"the {m} tier: {c}" for m, c in clauses if c != _clause(err))
    return type(err)(err.field, err.value, err.choices,
                     reason=f"{err.reason}; no tier prices this job ({why})")


def choose_method(spec: TrainingSpec, method: str | None = None) -> Choice:
    """The tier for `spec`: `method` when given; else the trace tier for what only it prices
    (the analytic tier's `refusal`), else hybrid when a GPU-calibrated learned model for this
    environment exists (`learned.predictor.default_method`), else analytic.

    One chooser for the Python API and the CLI. A job no tier prices is a `SpecError` naming
    each tier's refusal."""
    if method is not None:
        if method not in METHODS:
            raise SpecError("method", method, METHODS)
        return Choice(method, f"method={method!r} given")
    refused = refusal("analytic", spec)
    if refused is not None:
        if refusal("trace", spec) is not None:
            raise no_tier(refused, spec, "analytic")
        why = f"the analytic tier refuses {_clause(refused)}"
        return Choice("trace", why,
                      note=f"method: trace chosen because {why} (pass --method to override)")
    if spec.objective != "sft":  # the learned residuals were fit on SFT steps only
        return Choice("analytic", f"objective={spec.objective!r}: the learned tier is fit on "
                      "SFT steps only")
    try:  # by name, as METHODS: the learned tier sits above this module (tests/test_layers.py)
        default_method, models_root = map(_by_name, (LEARNED_POLICY, LEARNED_ROOT))
    except ImportError:  # the `learned` extra is not installed
        return Choice("analytic", "the learned extra is not installed (no hybrid tier)")
    if default_method(spec=spec) == "hybrid":
        return Choice("hybrid", "a GPU-calibrated learned model trained on this torch applies")
    return Choice("analytic", "no GPU-calibrated learned model trained on this torch and CUDA "
                  f"in {models_root()} (the models shipped with hybridmem, or $HYBRIDMEM_MODELS)")


def _by_name(target: str):
    module, func = target.split(":")
    return getattr(import_module(module), func)


# Upper end of the micro-batch search: the field's bound in the job schema (no job may ask
# for more), so the search takes at most ~2 log2(65536) = 32 probes
MAX_SEARCH_BATCH = TrainingSpec.__dataclass_fields__["micro_batch"].metadata["job"].maximum


def gpu_options(method: str, gpu: GPU | None) -> dict[str, object]:
    """What a tier is told about the target GPU: analytic and trace price its cuBLAS workspace
    (the same GPU to both, so they stay comparable); the hybrid residual is chosen per GPU type
    (its analytic base stays GPU-free, as its training rows were), and a job only the trace
    tier prices gets the GPU there."""
    if gpu is None:
        return {}
    if method == "hybrid":
        return {"gpu_name": gpu.name, "gpu": gpu}
    return {"gpu": gpu}


def estimator(method: str) -> Callable[[TrainingSpec], Prediction]:
    """The estimate function of a tier."""
    if method not in METHODS:
        raise SpecError("method", method, METHODS)
    module, func = METHODS[method].split(":")
    tier = getattr(import_module(module), func)
    if method in PER_RANK_TIERS:
        return tier
    # data-parallel specs are priced per rank (hybridmem/parallel)
    from hybridmem.parallel.estimate import per_rank_aware
    return per_rank_aware(tier)


GUIDED_METHODS: frozenset[str] = frozenset({"trace"})
"""Tiers whose micro-batch search starts at the analytic tier's answer (each probe of theirs
costs a trace; the analytic tier's costs milliseconds and lands within a few micro-batches)."""


def search_max(fits: Callable[[int], bool], guess: int | None = None) -> int:
    """Largest b in [1, MAX_SEARCH_BATCH] with `fits(b)` (0 if none), `fits` monotone.

    Without a `guess`: exponential search from 1, then bisection (O(log B) probes). With one:
    probe the guess, then steps of 1, 2, 4, ... up (it fits) or down (it does not) until the
    answer is bracketed, then bisection: two probes when the guess is right, O(log error)
    when not; the same answer as without."""
    if guess is None or guess < 1:
        if not fits(1):
            return 0
        lo, hi = 1, 2
        while hi <= MAX_SEARCH_BATCH and fits(hi):
            lo, hi = hi, hi * 2
        if hi > MAX_SEARCH_BATCH:
            return lo
    else:
        guess, step = min(guess, MAX_SEARCH_BATCH), 1
        if fits(guess):
            lo = guess
            while True:
                hi = lo + step
                if hi > MAX_SEARCH_BATCH:
                    hi = MAX_SEARCH_BATCH + 1
                    if lo == MAX_SEARCH_BATCH or fits(MAX_SEARCH_BATCH):
                        return MAX_SEARCH_BATCH
                    break
                if not fits(hi):
                    break
                lo, step = hi, step * 2
        else:
            hi = guess
            while True:
                lo = max(hi - step, 1)
                if fits(lo):
                    break
                if lo == 1:
                    return 0
                hi, step = lo, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def find_max_micro_batch(spec: TrainingSpec, gpu: GPU, method: str = "analytic",
                         **tier_options: object) -> int:
    """Largest micro-batch whose predicted device peak fits `gpu` (0 if even 1 does not fit).

    Peak memory is monotone in the micro-batch (`search_max`). A trace search starts at the
    analytic tier's answer where that tier prices the family (`GUIDED_METHODS`): a handful of
    traces instead of ~2 log2(B), in the process that already imported torch once.
    """
    run = estimator(method)
    options = {**gpu_options(method, gpu), **tier_options}
    from hybridmem.job.objective import micro_batch_step

    unit = micro_batch_step(spec)  # GRPO: whole groups of num_generations completions

    def fits(k: int) -> bool:
        return run(spec.with_(micro_batch=k * unit), **options).fits_within(gpu.memory_bytes)

    guess = None
    if method in GUIDED_METHODS and refusal("analytic", spec) is None:
        try:
            guess = find_max_micro_batch(spec, gpu, "analytic") // unit
        except SpecError:  # a spec only the trace tier takes: search unguided
            guess = None
    return search_max(fits, guess) * unit


def _over_lengths(spec: TrainingSpec, method: str, gpu: GPU | None, find_max_batch: bool,
                  tier_options: dict) -> Prediction:
    """The tier's answer over the run a lengths file makes (`hybridmem.batches.run`)."""
    from hybridmem.batches.run import simulate

    if find_max_batch:
        raise SpecError("find_max_batch", True, reason="not with --lengths (the batches "
                        "change with the micro-batch; search without --lengths)")
    run, options = estimator(method), {**gpu_options(method, gpu), **tier_options}
    return simulate(spec, method, lambda s: run(s, **options), gpu)


def predict(spec: TrainingSpec, method: str | None = None, gpu: GPU | None = None,
            find_max_batch: bool = False, **tier_options: object) -> Prediction:
    """Predict the peak memory of `spec`; with `gpu`, also whether it fits (and the max batch).

    `method`: the tier; None chooses it as the CLI does (`choose_method`). The answer's `method`
    is the tier that produced it and `extras["method_reason"]` says why. A tier that does not
    price the job (its `refusal`, or a trace that cannot run) is a one-line `SpecError` naming
    the tier that does, or saying that none does. `tier_options` go to the tier's estimate
    function (e.g. `timeline=` for the trace tier).
    """
    if find_max_batch and gpu is None:
        raise SpecError("find_max_batch", True, reason="needs a GPU (--gpu or --gpu-mem)")
    # unknown preset / bad config JSON / unknown model_type fail here, the same for every
    # tier, without importing transformers for the analytic families (that alone costs
    # seconds); a family only the trace tier prices is refused by the analytic tier's rule
    if is_analytic(model_type_of(spec.model)):
        light_config(spec.model)
    # attention and precision the user left open follow the model (families.defaults)
    filled = resolve_defaults(spec)
    spec = filled.spec
    choice = choose_method(spec, method)
    method = choice.method
    refused = refusal(method, spec)
    if refused is not None:
        raise no_tier(refused, spec, method)
    try:
        if spec.lengths is not None:  # the batches a dataset makes, step by step
            result = _over_lengths(spec, method, gpu, find_max_batch, tier_options)
        else:
            result = estimator(method)(spec, **{**gpu_options(method, gpu), **tier_options})
        max_batch = None
        if gpu is not None and find_max_batch:
            # the timeline file belongs to the spec as asked, not to the search's probes
            search_options = {k: v for k, v in tier_options.items() if k != "timeline"}
            max_batch = find_max_micro_batch(spec, gpu, method, **search_options)
    except UnsupportedModelError as err:  # the trace tier could not run the model's code
        raise no_tier(err, spec, "trace") from err
    notes = result.notes if choice.note is None else (*result.notes, choice.note)
    if filled.defaults.get("attn") and spec.attn != "sdpa":  # the one default worth a note
        notes = (*notes, f"attn={spec.attn}: {filled.defaults['attn']}")
    # a tier that answered with another one (the hybrid tier's fallbacks) says why itself
    # every answer says what job it priced, with the schema's names
    job = {**job_dict(spec), "defaults": filled.defaults} if filled.defaults else job_dict(spec)
    result = dataclasses.replace(result, notes=notes, job=job,
                                 extras={"method_reason": choice.reason, **result.extras,
                                         "environment": environment.versions()})
    if gpu is None:
        return result
    return dataclasses.replace(result, gpu_name=gpu.name, gpu_memory_bytes=gpu.memory_bytes,
                               max_micro_batch=max_batch)
