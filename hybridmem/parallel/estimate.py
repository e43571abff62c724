"""`estimate_per_rank`: a single-GPU Prediction turned into one rank's Prediction.

Data parallelism leaves each rank's micro-batch, and hence its activations, kernel workspaces
and CUDA context, exactly as on one GPU; it changes where parameters, gradients and optimizer
state live and adds communication buffers. So the single-GPU tier prices the activation side
and `hybridmem.parallel.sharding` prices the model states per rank. The peak is the larger of

- forward/backward: over the points of the single-GPU timeline, resident states + gathered
  params + reduction buffers + that point's activations and temporaries, with the grads that
  grow during backward scaled by how far the backward has got;
- optimizer step: resident states + the step's transient tensors (on the rank's shard only).

With the analytic tier, every timeline point is used (`analytic_points`). Any other tier gives
only its peak's breakdown; if that peak is in the optimizer step it holds no activations, so
the activation side comes from a second estimate with plain SGD (and, under bf16-master, the
pure-bf16 twin), whose peak is then in forward/backward: activations do not depend on the
optimizer.

Fragmentation (reserved - allocated) is priced per rank too: the single-GPU job's analytic
stream is rewritten with the rank's sharded states and buffers (`hybridmem.parallel.stream`)
and replayed through the allocator simulator, within the rank's allocator capacity when a GPU
is given (its memory minus the CUDA context and NCCL's buffers). Where the analytic tier has no
stream (`train='peft'`), the single-GPU tier's figure is kept, and a note says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hybridmem.allocator.overheads import CUDA_CONTEXT_DEFAULT, cublas_workspace
from hybridmem.allocator.reserved import Bounded, at_batch, bounded, capacity_notes
from hybridmem.categories import TENSOR_CATEGORIES, empty_breakdown
from hybridmem.errors import SpecError
from hybridmem.gpus import GPU
from hybridmem.parallel.phases import (  # noqa: F401 (NCCL_* read as estimate.NCCL_BYTES)
    NCCL_BUFFSIZE, NCCL_BYTES, NCCL_CHANNELS, NCCL_RING_PEERS, ActPoint, forward_precision,
    fwd_bwd, rank_capacity,
)
from hybridmem.parallel.phases import step as step_phase
from hybridmem.parallel.sharding import RankStates, rank_states, replicated
from hybridmem.job.parallel import ParallelSpec
from hybridmem.parallel.states import model_tensors
from hybridmem.parallel.validate import check_parallel
from hybridmem.prediction import Peak, Prediction
from hybridmem.families.defaults import as_job
from hybridmem.job.resolved import Job
from hybridmem.job.spec import TrainingSpec

Estimator = Callable[[TrainingSpec], Prediction]


# Pure 16-bit twins of the master-weight policy: same compute dtype, hence same activations,
# without the fp32 master copy whose step can still out-peak the backward under plain SGD.
PURE_TWIN = {"bf16-master": "bf16"}


def _activation_side(spec: TrainingSpec, estimate: Estimator,
                     timeline_known: bool = False) -> tuple[Prediction, Prediction]:
    """(single-GPU prediction, a prediction whose peak is in forward/backward).

    Tries the spec, then plain SGD, then SGD with the pure 16-bit twin of the precision; if all
    still peak in the step, the activations are small and the last one's are used as they are.
    `timeline_known`: the caller has every forward/backward point (`analytic_points`), so the
    second prediction is not needed and the base one is returned twice (each estimate replays
    its stream through the allocator simulator: most of `--gpu`'s advice time).
    """
    single = spec.with_(parallel=ParallelSpec(), precision=forward_precision(spec))
    base = estimate(single)
    candidates = [single.with_(optimizer="sgd")]
    if single.precision in PURE_TWIN:
        candidates.append(candidates[0].with_(precision=PURE_TWIN[single.precision]))
    fwd = base
    for candidate in () if timeline_known else candidates:
        if fwd.peak.phase != "optimizer":
            break
        fwd = estimate(candidate)
    return base, fwd


def _prediction_point(fwd: Prediction, single: RankStates) -> ActPoint:
    grown = min(1.0, fwd.breakdown["grad"] / single.grad) if single.grad else 1.0
    phase = fwd.peak.phase if fwd.peak.phase != "optimizer" else "backward"
    return ActPoint(phase, grown, fwd.breakdown["activation"], fwd.breakdown["temporary"])


def analytic_points(spec: TrainingSpec) -> list[ActPoint]:
    """Every forward/backward point of the analytic tier's timeline (`analytic.estimate.timeline`)."""
    from hybridmem.analytic.estimate import timeline

    _, _, points = timeline(spec.with_(parallel=ParallelSpec(), precision=forward_precision(spec)))
    full = max((p.bytes["grad"] for p in points), default=0)
    return [ActPoint(p.phase, p.bytes["grad"] / full if full else 1.0, p.bytes["activation"],
                     p.bytes["temporary"]) for p in points if p.phase != "optimizer"]


def _peak(breakdown: dict, base: Prediction, phase: str, iteration: int) -> Peak:
    """Allocated / reserved / device: tensors, then the single-GPU non-tensor terms on top."""
    allocated = sum(breakdown[c] for c in TENSOR_CATEGORIES)
    base_alloc_extra = base.peak.allocated_bytes - sum(base.breakdown[c] for c in TENSOR_CATEGORIES)
    allocated += max(0, base_alloc_extra)
    device = sum(breakdown.values())
    reserved = min(device, allocated + breakdown["fragmentation"]
                   + max(0, base.peak.reserved_bytes - base.peak.allocated_bytes
                         - base.breakdown["fragmentation"]))
    return Peak(allocated_bytes=min(allocated, reserved), reserved_bytes=reserved,
                device_bytes=device, phase=phase, iteration=iteration)


def _scaled_modules(base: Prediction, rank: RankStates, single: RankStates) -> tuple:
    """Per-module param/grad/optimizer scaled by the per-rank / single-GPU ratio of each."""
    def f(x: int, num: int, den: int) -> int:
        return round(x * num / den) if den else x
    return tuple(dataclasses.replace(
        m, param=f(m.param, rank.param, single.param), grad=f(m.grad, rank.grad, single.grad),
        optimizer=f(m.optimizer, rank.optimizer, single.optimizer)) for m in base.modules)


def rank_fragmentation(spec: TrainingSpec, gpu: GPU | None) -> Bounded | None:
    """Fragmentation of one rank: its stream (`parallel.stream.rank_events`) replayed within
    `rank_capacity`, kept non-decreasing in the micro-batch as the analytic tier's
    (`allocator.reserved.bounded`, in the stream's own allocated units). None where the
    analytic tier has no stream for the spec."""
    from hybridmem.allocator.config import alloc_conf_string
    from hybridmem.parallel.stream import measure_with

    measure = measure_with(cublas_workspace(gpu))
    capacity = rank_capacity(spec, gpu)
    try:
        allocated = at_batch(spec, spec.micro_batch, measure, alloc_conf_string(), capacity)[0]
        return bounded(spec, allocated, measure, capacity)
    except SpecError:
        return None


def _rank_notes(spec: Job, base: Prediction, fit, breakdown: dict, nccl: int,
                gpu: GPU | None) -> tuple[str, ...]:
    """The single-GPU answer's notes, less the caveats the rank answers, and the rank's own."""
    ps = spec.parallel
    # single-GPU caveats this module answers (ZeRO's fp32 grad partition is priced in the step)
    answered = ("DeepSpeed's extra fp32 gradient buffers",) if ps.zero_stage else ()
    notes = [n for n in base.notes if not any(a in n for a in answered)] + [
        f"per rank of {ps.world_size} GPUs ({ps.strategy}); activations are per micro-batch of "
        f"{spec.micro_batch} on each GPU",
    ]
    if nccl:
        notes.append(f"NCCL buffers outside PyTorch: nominal {nccl / 2**20:.0f} MiB in context")
    if fit is None:
        notes.append("fragmentation: the single-GPU tier's (the analytic tier has no stream "
                     "for this spec to replay per rank)")
    else:
        notes.append("fragmentation per rank: the analytic stream with this rank's sharded "
                     "states and buffers, replayed through the allocator simulator "
                     "(hybridmem.parallel.stream)")
        tensors = sum(breakdown[c] for c in TENSOR_CATEGORIES)
        notes += capacity_notes(fit, tensors, f"{gpu.name if gpu else 'the GPU'}'s memory "
                                f"minus {(CUDA_CONTEXT_DEFAULT + nccl) >> 20} MiB outside "
                                "PyTorch's allocator (CUDA context, NCCL buffers)")
    if ps.strategy == "zero1":
        notes.append("ZeRO-1 keeps full gradients (ZeRO paper P_os); DeepSpeed may free the other "
                     "ranks' grads at the accumulation boundary, making this an upper bound")
    return tuple(notes)


def estimate_per_rank(spec: Job, single_gpu_estimate: Estimator,
                      points: Callable[[TrainingSpec], list[ActPoint]] | None = None,
                      gpu: GPU | None = None) -> Prediction:
    """Peak memory of one rank of `spec` (per GPU), given any single-GPU tier's estimate;
    `points` (e.g. `analytic_points`) gives the whole forward/backward timeline when known;
    `gpu` sets the cuBLAS workspace of the rank's stream and the capacity it is replayed within
    (`rank_fragmentation`); `single_gpu_estimate` should then replay without a capacity, as its
    own fragmentation is not used unless the rank has no stream."""
    check_parallel(spec)
    ps = spec.parallel
    base, fwd = _activation_side(spec, single_gpu_estimate, timeline_known=points is not None)
    mt = model_tensors(spec)
    states = rank_states(spec, mt)
    single_states = replicated(spec, mt)
    nccl = NCCL_BYTES if ps.world_size > 1 else 0
    fit = rank_fragmentation(spec, gpu)
    extra = {"workspace": base.breakdown["workspace"],
             # the single GPU's paged optimizer state replaced by this rank's (outside the
             # allocator, like the context; Prediction.paged_bytes)
             "context": base.breakdown["context"] - base.paged_bytes + states.paged + nccl,
             "fragmentation": base.breakdown["fragmentation"] if fit is None
             else fit.fragmentation}
    acts = points(spec) if points is not None else [_prediction_point(fwd, single_states)]
    fwd_phase, fwd_best = max(((p.phase, fwd_bwd(states, p, extra)) for p in acts),
                              key=lambda pb: sum(pb[1].values()))
    phases = {fwd_phase: fwd_best, "optimizer": step_phase(states, base, extra)}
    phase = max(phases, key=lambda k: sum(phases[k].values()))
    # optimizer state exists from the first step on, so a forward/backward peak that includes
    # it is at iteration 1; the step's own peak is already there at iteration 0
    iteration = 0 if phase == "optimizer" or states.optimizer == 0 else 1
    breakdown = phases[phase]
    if fit is not None and fit.capacity is not None and fit.completed:
        # the rank's replay completed within its capacity: reserved stays within it, as the
        # allocator frees its cache before reserving more (`allocator.reserved.bounded`)
        tensors = sum(breakdown[c] for c in TENSOR_CATEGORIES)
        breakdown["fragmentation"] = min(breakdown["fragmentation"],
                                         max(0, fit.capacity - tensors))
    if fit is not None and fit.capacity is not None and gpu is not None:
        # the rank's own peak decides whether its allocator runs out (as `Prediction.fits`:
        # the capacity is the GPU's memory less what the rank holds outside the allocator)
        over = sum(breakdown.values()) - states.paged > gpu.memory_bytes
        fit = dataclasses.replace(fit, over_capacity=over)
    notes = _rank_notes(spec, base, fit, breakdown, nccl, gpu)
    extras = dict(base.extras)
    extras.update({
        "world_size": ps.world_size, "strategy": ps.strategy, "per_rank": True,
        "zero_stage": ps.zero_stage,
        "phases": {k: dict(v) for k, v in phases.items()},
        "parallel_buffers": dict(states.detail),
        "single_gpu_states": {"param": single_states.param, "grad": single_states.grad,
                              "optimizer": single_states.optimizer},
        "single_gpu_device_bytes": base.peak.device_bytes,
    })
    if fit is not None and fit.capacity is not None:
        extras["allocator"] = {"capacity_bytes": fit.capacity, "num_alloc_retries": fit.retries,
                               "oom": fit.oom}
    return dataclasses.replace(
        base, method=f"{base.method}+{ps.strategy}", breakdown=breakdown,
        modules=_scaled_modules(base, states, single_states),
        peak=_peak(breakdown, base, phase, iteration), notes=notes, extras=extras,
        max_micro_batch=None, paged_bytes=states.paged)


def per_rank_aware(single_gpu_estimate: Callable[..., Prediction], *,
                   model_parallel: Callable[..., Prediction],
                   points: Callable[[TrainingSpec], list[ActPoint]] | None = None,
                   ) -> Callable[..., Prediction]:
    """Wrap a tier's estimate so that data-parallel specs are priced per rank (the hook used by
    `hybridmem.tiers.estimator`); tier options go to the single-GPU estimate. What the tier
    lends comes from its protocol (`tiers/protocol.py`): `points`, its whole forward/backward
    timeline where it knows one (`analytic_points`); `model_parallel`, how it prices tp / sp /
    pp ranks, `(spec, gpu=) -> Prediction`."""

    def run(spec: TrainingSpec, **options: object) -> Prediction:
        spec = as_job(spec)  # the tier's entry: a Job as it is; a plain spec's defaults filled
        if spec.parallel.model_parallel:
            return model_parallel(spec, gpu=options.get("gpu"))
        if spec.parallel.strategy == "none":
            return single_gpu_estimate(spec, **options)
        # the single-GPU job replays unlimited: its reserved bytes are not the rank's, which
        # `estimate_per_rank` replays within the rank's own capacity
        single = {**options, "capacity": None}
        return estimate_per_rank(spec, lambda s: single_gpu_estimate(s, **single), points,
                                 gpu=options.get("gpu"))
    return run


def analytic_ranks(spec: TrainingSpec, gpu: GPU | None = None) -> Prediction:
    """The analytic tier's model-parallel ranks (`parallel.ranks.price_ranks`): the highest
    rank's answer."""
    from hybridmem.parallel.ranks import price_ranks

    return price_ranks(spec, gpu=gpu)[0]
