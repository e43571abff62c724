"""`--gpu` advice: the smallest change that makes a job fit (world size, ZeRO stage, checkpointing).

Per-rank memory never grows with the world size under sharding (every sharded term is a
ceil(x / N)), so the smallest fitting world size is found by doubling then bisection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import cache

from hybridmem.errors import SpecError
from hybridmem.gpus import GPU
from hybridmem.job.objective import micro_batch_step
from hybridmem.job.precision import deepspeed_precision
from hybridmem.prediction import Prediction
from hybridmem.job.spec import TrainingSpec

MAX_WORLD_SIZE = 4096  # where the doubling search gives up: a search bound, not a framework limit
SHARDED = ("zero1", "zero2", "zero3", "fsdp")


def _with_parallel(spec: TrainingSpec, **changes) -> TrainingSpec:
    parallel = replace(spec.parallel, **changes)
    return spec.with_(parallel=parallel,
                      precision=deepspeed_precision(parallel.strategy, spec.precision))


def _option(spec: TrainingSpec, pred: Prediction, gpu: GPU) -> dict:
    # headroom against what the verdict compares (`Prediction.verdict_bytes`), as `fits` does
    return {"world_size": spec.parallel.world_size, "strategy": spec.parallel.strategy,
            "grad_ckpt": spec.grad_ckpt, "peak_bytes": pred.peak.device_bytes,
            "headroom_bytes": gpu.memory_bytes - pred.verdict_bytes}


def _fits(spec: TrainingSpec | Callable[[], TrainingSpec], gpu: GPU,
          estimate: Callable) -> Prediction | None:
    """The prediction of `spec` if it fits `gpu`; None if it does not, or if the spec (or a
    callable building it) is refused (e.g. sharding quantised weights)."""
    try:
        pred = estimate(spec() if callable(spec) else spec)
    except SpecError:
        return None
    return pred if pred.fits_within(gpu.memory_bytes) else None


def _smallest_world_size(spec: TrainingSpec, gpu: GPU, estimate: Callable) -> dict | None:
    strategy = spec.parallel.strategy if spec.parallel.strategy in SHARDED else "zero3"
    at = lambda n: _with_parallel(spec, world_size=n, strategy=strategy)  # noqa: E731
    # each size is estimated once; a sharding the spec refuses fits at no size
    fits_at = cache(lambda n: _fits(lambda: at(n), gpu, estimate))
    lo, hi = 1, 2
    while hi <= MAX_WORLD_SIZE and fits_at(hi) is None:
        lo, hi = hi, hi * 2
    if hi > MAX_WORLD_SIZE:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits_at(mid) is not None else (mid, hi)
    return _option(at(hi), fits_at(hi), gpu)


def _smallest_zero_stage(spec: TrainingSpec, gpu: GPU, estimate: Callable) -> dict | None:
    if spec.parallel.world_size < 2 or spec.parallel.strategy == "fsdp":
        return None
    first = spec.parallel.zero_stage + 1
    for stage in range(first, 4):
        try:
            candidate = _with_parallel(spec, strategy=f"zero{stage}")
        except SpecError:  # a stage this job cannot use (e.g. ZeRO-3 with quantised weights)
            continue
        if (pred := _fits(candidate, gpu, estimate)) is not None:
            return _option(candidate, pred, gpu)
    return None


def _largest_micro_batch(spec: TrainingSpec, gpu: GPU, estimate: Callable) -> dict | None:
    """Largest micro-batch below the current one that fits ("how far must I go down?")."""
    unit = micro_batch_step(spec)  # GRPO: whole groups of num_generations completions
    fits_at = cache(lambda k: _fits(spec.with_(micro_batch=k * unit), gpu, estimate))
    lo, hi = 0, spec.micro_batch // unit  # invariant: hi does not fit; lo fits (or is 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
    if lo == 0:
        return None
    return {**_option(spec.with_(micro_batch=lo * unit), fits_at(lo), gpu),
            "micro_batch": lo * unit}


def smallest_fitting_setup(spec: TrainingSpec, gpu: GPU,
                           estimate: Callable[[TrainingSpec], Prediction]) -> dict:
    """What makes `spec` fit `gpu`: as is; else the smallest world size (same sharding, or ZeRO-3
    if the job does not shard), the smallest higher ZeRO stage at this world size, and turning
    on gradient checkpointing, and the largest smaller micro-batch. `estimate` must price parallel
    specs (e.g. `predict`). Options that do not fit are None."""
    current = estimate(spec)
    out: dict = {"gpu": gpu.name, "gpu_memory_bytes": gpu.memory_bytes,
                 "fits_as_is": current.fits_within(gpu.memory_bytes),
                 "current": _option(spec, current, gpu),
                 "world_size": None, "zero_stage": None, "grad_ckpt": None, "micro_batch": None}
    if out["fits_as_is"]:
        return out
    out["world_size"] = _smallest_world_size(spec, gpu, estimate)
    out["zero_stage"] = _smallest_zero_stage(spec, gpu, estimate)
    out["micro_batch"] = _largest_micro_batch(spec, gpu, estimate)
    if not spec.grad_ckpt:
        candidate = spec.with_(grad_ckpt=True)
        if (pred := _fits(candidate, gpu, estimate)) is not None:
            out["grad_ckpt"] = _option(candidate, pred, gpu)
    return out
