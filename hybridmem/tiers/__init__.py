"""The tiers behind one protocol (`tiers/protocol.py`): each tier's refusal rule, its estimate
(sharded per rank for a multi-GPU spec), what it is told about the GPU, and the advice when a
tier refuses a job.

The analytic and the trace tier are imported here (`tiers/analytic.py`, `tiers/trace.py`). The
learned tier sits above (its training tools read the harness's rows and call `predict`), so it
registers itself (`learned/tier.py`, imported by `hybridmem/__init__.py`, the package's entry
point, before any caller can ask for a tier): no tier is looked up by a name string, and the
import graph the layers check holds every edge.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridmem.errors import SpecError
from hybridmem.gpus import GPU
from hybridmem.job.spec import TrainingSpec
from hybridmem.prediction import Prediction
from hybridmem.tiers import analytic, trace
from hybridmem.tiers.protocol import Tier

TIERS: dict[str, Tier] = {t.name: t for t in (analytic.TIER, trace.TIER)}
"""The tiers by `--method` name; `register` adds the ones that sit above this layer."""

SCOPES: tuple[str, ...] = ("analytic", "trace")
"""The tiers with a refusal rule of their own, kept next to the tier (`analytic/scope.py`,
torch-free, and `trace/scope.py`); the others' rules are made of these."""


def register(tier: Tier) -> Tier:
    """Add a tier that sits above this layer (the learned one); returns it."""
    TIERS[tier.name] = tier
    return tier


def tier(method: str) -> Tier:
    """The tier `method` names; a SpecError naming the tiers known."""
    try:
        return TIERS[method]
    except KeyError:
        raise SpecError("method", method, tuple(TIERS)) from None


def per_rank_tiers() -> frozenset[str]:
    """The tiers that price a multi-GPU job per rank themselves (`Tier.per_rank`)."""
    return frozenset(name for name, t in TIERS.items() if t.per_rank)


def refusal(method: str, spec: TrainingSpec) -> SpecError | None:
    """Why tier `method` does not price `spec`, None if it does (or no such tier)."""
    found = TIERS.get(method)
    return None if found is None else found.refusal(spec)


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
    """What tier `method` is told about the target GPU (`Tier.gpu_options`)."""
    return tier(method).gpu_options(gpu)


def single_gpu(method: str) -> Callable[..., Prediction]:
    """The estimate function of tier `method` (`Tier.single_gpu`)."""
    return tier(method).single_gpu()


def estimator(method: str) -> Callable[[TrainingSpec], Prediction]:
    """Tier `method`'s estimate; a multi-GPU spec is priced per rank, by the per-rank wrapper
    (`hybridmem.parallel.estimate.per_rank_aware`) unless the tier prices ranks itself."""
    found = tier(method)
    if found.per_rank:
        return found.single_gpu()
    from hybridmem.parallel.estimate import per_rank_aware

    return per_rank_aware(found.single_gpu(), model_parallel=found.model_parallel(),
                          points=found.timeline())
