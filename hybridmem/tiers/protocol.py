"""What a tier provides: the chooser, `predict`, the micro-batch search, `parallel/` and every
refusal's advice call these, never a tier's module by name.

A tier is one object (`analytic.TIER`, `trace.TIER`, the learned tier's `learned.tier.TIER`):
its refusal rule (model-config only, kept next to the tier), its estimate of a resolved `Job`,
whether it prices a multi-GPU job per rank itself, and what it is told about the target GPU.
`hybridmem.tiers.estimator` wraps a tier that does not price ranks in the per-rank wrapper (`parallel.estimate.per_rank_aware`), so `parallel/` shards any tier through this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hybridmem.errors import SpecError
    from hybridmem.gpus import GPU
    from hybridmem.job.spec import TrainingSpec
    from hybridmem.prediction import Prediction


class Tier(Protocol):
    name: str
    """The `--method` name."""
    per_rank: bool
    """True where the tier prices a multi-GPU job per rank itself (its answer is not sharded
    again); False: `tiers.estimator` wraps it per rank."""

    def refusal(self, spec: TrainingSpec) -> SpecError | None:
        """Why the tier does not price `spec` (a one-line SpecError), None if it does."""

    def single_gpu(self) -> Callable[..., Prediction]:
        """The tier's estimate function, `(spec: Job, **options) -> Prediction` (options:
        `gpu=`, `timeline=`, ...), imported when asked for: on one GPU, or per rank where
        `per_rank` (the function itself, which the per-rank wrapper recognises)."""

    def gpu_options(self, gpu: GPU | None) -> dict[str, object]:
        """The estimate's options for the target GPU (empty without one)."""

    def timeline(self) -> Callable[[TrainingSpec], list] | None:
        """Every forward/backward point of the step, `(spec) -> [ActPoint]`, where the tier
        knows them (the per-rank wrapper then places each rank's collectives on them); None:
        the wrapper reads the points off the tier's answer. Read only where not `per_rank`."""

    def model_parallel(self) -> Callable[..., Prediction]:
        """How the tier prices a tp / sp / pp / cp / ep job's ranks, `(spec: Job, gpu=) ->
        Prediction` (the highest rank's answer). Read only where not `per_rank`."""


class OneGpuTier:
    """What the analytic and the trace tier share: each prices one GPU and is sharded per rank
    by the wrapper (`per_rank` False), told the target GPU itself (its cuBLAS workspace and
    capacity, the same for both, so their answers stay comparable)."""

    per_rank = False

    @staticmethod
    def gpu_options(gpu: GPU | None) -> dict[str, object]:
        return {} if gpu is None else {"gpu": gpu}
