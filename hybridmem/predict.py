"""The public Python API: `predict(spec, method=...) -> Prediction`.

Tiers are looked up by name and imported lazily, so `import hybridmem` stays fast and the
analytic tier never pays for torch-heavy tiers it does not use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from importlib import import_module

from hybridmem.errors import SpecError
from hybridmem.gpus import GPU
from hybridmem.models.light import light_config
from hybridmem.models.loader import is_analytic, model_type_of
from hybridmem.prediction import Prediction
from hybridmem.job.spec import TrainingSpec

# method name -> "module:function" taking a TrainingSpec and returning a Prediction
METHODS: dict[str, str] = {
    "analytic": "hybridmem.analytic:estimate",
    "trace": "hybridmem.trace:estimate",
    "hybrid": "hybridmem.learned.predictor:estimate",
}

PER_RANK_TIERS: frozenset[str] = frozenset({"hybrid"})
"""Tiers that price a multi-GPU spec per rank themselves: the learned tier's base is already the
per-rank analytic estimate (`learned.features.analytic_base`), and its residual was trained on
that base with the strategy among the features, so sharding its answer again would serve a
different path than `hybridmem evaluate` scores."""

# The tier a spec only it can price gets: no closed form prices an arbitrary PEFT method
# (`train='peft'`) or a transformers family outside the analytic tier's (issue 11).
TRACE_ONLY_METHOD = "trace"


def trace_only_reason(spec) -> str | None:
    """Why only the trace tier can price `spec` (a clause for the notes), None if others can.

    One mechanism for every such case: the CLI's `resolve_method` picks the trace tier when
    there is a reason and says which; the hybrid tier answers with the trace tier then (its
    residuals correct the analytic tier)."""
    if spec.train == "peft":
        from hybridmem.adapters import peft_type

        return f"{peft_type(spec)} adapters have no closed form"
    from hybridmem.models.loader import is_analytic, model_type_of

    model_type = model_type_of(spec.model)
    if not is_analytic(model_type):
        return f"model_type={model_type!r} has no closed form in the analytic tier"
    from hybridmem.families.decoders.model import MOE_TYPES

    if model_type in MOE_TYPES and (spec.train != "full" or spec.precision != "bf16"):
        # the MoE closed forms are full bf16 only (analytic.estimate._setup, docs/families.md)
        return (f"{model_type} with train={spec.train!r}, precision={spec.precision!r} has no "
                "closed form in the analytic tier (full bf16 only)")
    return None


# Upper end of the micro-batch search; far beyond any GPU today for the smallest presets.
MAX_SEARCH_BATCH = 1 << 16


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
    # --- parallel hook (issue 6, hybridmem/parallel): data-parallel specs are priced per rank ---
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

    def fits(batch: int) -> bool:
        return run(spec.with_(micro_batch=batch), **options).fits_within(gpu.memory_bytes)

    guess = None
    if method in GUIDED_METHODS and trace_only_reason(spec) is None:
        try:
            guess = find_max_micro_batch(spec, gpu, "analytic")
        except SpecError:  # a spec only the trace tier takes: search unguided
            guess = None
    return search_max(fits, guess)


def predict(spec: TrainingSpec, method: str = "analytic", gpu: GPU | None = None,
            find_max_batch: bool = False, **tier_options: object) -> Prediction:
    """Predict the peak memory of `spec`; with `gpu`, also whether it fits (and the max batch).

    `tier_options` go to the tier's estimate function (e.g. `timeline=` for the trace tier).
    """
    if find_max_batch and gpu is None:
        raise SpecError("find_max_batch", True, reason="needs a GPU (--gpu or --gpu-mem)")
    # unknown preset / bad config JSON / unknown model_type fail here, the same for every
    # tier, without importing transformers for the analytic families (that alone costs
    # seconds); a family only the trace tier prices is refused by the analytic tier itself
    if is_analytic(model_type_of(spec.model)):
        light_config(spec.model)
    result = estimator(method)(spec, **{**gpu_options(method, gpu), **tier_options})
    if gpu is None:
        return result
    # the timeline file belongs to the spec as asked, not to the search's probes
    search_options = {k: v for k, v in tier_options.items() if k != "timeline"}
    max_batch = (find_max_micro_batch(spec, gpu, method, **search_options)
                 if find_max_batch else None)
    return dataclasses.replace(result, gpu_name=gpu.name, gpu_memory_bytes=gpu.memory_bytes,
                               max_micro_batch=max_batch)
