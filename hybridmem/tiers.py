"""The single-GPU tiers below the chooser, imported rather than looked up by name: each tier's
refusal rule, its estimate function (sharded per rank for a multi-GPU spec), and the advice
when a tier refuses a job.

Why its own module, below `intake` and the learned tier: the learned tier prices on top of the
analytic tier and falls back to the trace tier, and the chooser (`intake.resolve`) reads the
same rules; with these in `predict.py` the learned tier imported the module that loads it, a
cycle no import graph showed (the tiers were named by strings).
"""

from __future__ import annotations

from collections.abc import Callable

from hybridmem.errors import SpecError
from hybridmem.gpus import GPU
from hybridmem.job.spec import TrainingSpec
from hybridmem.prediction import Prediction

SCOPES: tuple[str, ...] = ("analytic", "trace")
"""The tiers with a refusal rule of their own (`refusal(spec) -> SpecError | None`, kept next to
the tier: `analytic/scope.py`, torch-free, and `trace/scope.py`)."""

PER_RANK_TIERS: frozenset[str] = frozenset({"hybrid"})
"""Tiers that price a multi-GPU spec per rank themselves: the learned tier's base is already the
per-rank analytic estimate (`learned.features.analytic_base`), and its residual was trained on
that base with the strategy among the features, so sharding its answer again would serve a
different path than `hybridmem evaluate` scores."""


def refusal(method: str, spec: TrainingSpec) -> SpecError | None:
    """Why tier `method` does not price `spec`, None if it does. The hybrid tier answers with
    the trace tier where the analytic one refuses (`learned.predictor.estimate`), so it refuses
    only what both refuse."""
    if method == "hybrid":
        refused = refusal("analytic", spec)
        return refused if refused is not None and refusal("trace", spec) is not None else None
    if method == "analytic":
        from hybridmem.analytic.scope import refusal as rule
    elif method == "trace":
        from hybridmem.trace.scope import refusal as rule
    else:
        return None
    return rule(spec)


def clause(err: SpecError) -> str:
    """`field='value': reason`, as the advice quotes a refusal."""
    return f"{err.field}={err.value!r}: {err.reason}"


def no_tier(err: SpecError, spec: TrainingSpec, method: str) -> SpecError:
    """`err` (tier `method` refuses `spec`) with the way out: the first other tier whose rule
    admits the job, or that none does and why."""
    others = [m for m in SCOPES if m != method]
    for other in others:
        if refusal(other, spec) is None:
            return type(err)(err.field, err.value, err.choices,
                             reason=f"{err.reason}; use --method {other}")
    clauses = [(m, clause(refusal(m, spec))) for m in others]
    why = "; ".join(f"the {m} tier: {c}" for m, c in clauses if c != clause(err))
    return type(err)(err.field, err.value, err.choices,
                     reason=f"{err.reason}; no tier prices this job ({why})")


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


def single_gpu(method: str) -> Callable[..., Prediction]:
    """The estimate function of the analytic or the trace tier, on one GPU."""
    if method == "analytic":
        from hybridmem.analytic import estimate
    elif method == "trace":
        from hybridmem.trace import estimate
    else:
        raise SpecError("method", method, SCOPES)
    return estimate


def estimator(method: str) -> Callable[[TrainingSpec], Prediction]:
    """The analytic or the trace tier's estimate; a data-parallel spec is priced per rank
    (`hybridmem.parallel.estimate.per_rank_aware`)."""
    from hybridmem.parallel.estimate import per_rank_aware

    return per_rank_aware(single_gpu(method))
