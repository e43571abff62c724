"""`--gpu` advice: the smallest change that makes a job fit (world size, ZeRO stage, checkpointing),
and, where no single change does, the changes a user would combine: memory savers (gradient
checkpointing, Liger's fused loss, Cut Cross-Entropy) with the largest micro-batch that then
fits, or with the smallest world size.

Per-rank memory never grows with the world size under sharding (every sharded term is a
ceil(x / N)), so the smallest fitting world size is found by doubling then bisection; it never
grows as the micro-batch shrinks either, so the largest fitting micro-batch is a bisection.
The combined search is bounded: at most `MAX_COMBINED_PROBES` estimates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import cache

from hybridmem.errors import SpecError
from hybridmem.families.defaults import as_job
from hybridmem.job.resolved import Job
from hybridmem.gpus import GPU
from hybridmem.objectives import micro_batch_step
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


def _largest_micro_batch(spec: TrainingSpec, gpu: GPU, estimate: Callable,
                         start: int | None = None) -> dict | None:
    """Largest micro-batch below `start` (default: the current one) that fits ("how far must
    I go down?")."""
    unit = micro_batch_step(spec)  # GRPO: whole groups of num_generations completions
    fits_at = cache(lambda k: _fits(spec.with_(micro_batch=k * unit), gpu, estimate))
    hi = (spec.micro_batch if start is None else start) // unit
    lo = 0  # invariant: hi does not fit (or is past the job's); lo fits (or is 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
    if lo == 0:
        return None
    return {**_option(spec.with_(micro_batch=lo * unit), fits_at(lo), gpu),
            "micro_batch": lo * unit}


MAX_COMBINED_PROBES = 48
"""Estimates the combined search may make (each is one answer of the chosen tier): with 3 saver
sets a bisection over micro-batches up to 2^12 takes 3 x 13; a search bound, not a tuned value."""

SAVERS: tuple[dict, ...] = (
    {"grad_ckpt": True},
    {"grad_ckpt": True, "liger": True},
    {"grad_ckpt": True, "cut_cross_entropy": True},
)
"""The memory savers a user turns on, alone and with each other, cheapest to adopt first: each
is one flag or config key (`--grad-ckpt`, `--liger`, `--cut-cross-entropy`); a set the job
refuses (a family Liger does not patch, Cut Cross-Entropy on fp32 weights) is skipped."""
SAVER_NAMES: dict[str, str] = {"grad_ckpt": "checkpointing", "liger": "Liger",
                               "cut_cross_entropy": "Cut Cross-Entropy"}


class _Budget:
    """`estimate` with a cap on how many times it runs (`MAX_COMBINED_PROBES`)."""

    def __init__(self, estimate: Callable, probes: int = MAX_COMBINED_PROBES) -> None:
        self.estimate, self.left = estimate, probes

    def __call__(self, spec: TrainingSpec) -> Prediction:
        if self.left <= 0:
            raise SpecError("advice", "search", reason="out of probes")  # = does not fit
        self.left -= 1
        return self.estimate(spec)


def _saver_sets(spec: TrainingSpec) -> list[tuple[str, TrainingSpec]]:
    """(label, spec with the savers on) for each `SAVERS` set, less the savers already on, that
    changes the job and that the job accepts (a SpecError from `with_`: skipped)."""
    spec = as_job(spec)  # the savers' own checks read the precision the model decides
    out = []
    for changes in SAVERS:
        new = {k: v for k, v in changes.items() if getattr(spec, k) != v}
        if not new or any(label == _label(new) for label, _ in out):
            continue
        try:
            out.append((_label(new), spec.with_(**new)))
        except SpecError:
            continue
    return out


def _label(changes: dict) -> str:
    return " + ".join(SAVER_NAMES[k] for k in changes)


def _combined(spec: TrainingSpec, gpu: GPU, estimate: Callable, job: Job | None = None
              ) -> list[dict]:
    """For each `SAVERS` set the job accepts, the savers with the largest micro-batch (at most
    the job's) that then fits; where none does, checkpointing with the smallest world size.
    Empty when nothing fits within the probe budget."""
    budget = _Budget(estimate)
    sets = _saver_sets(spec if job is None else job)
    out = []
    for label, saved in sets:
        option = _largest_micro_batch(saved, gpu, budget, start=saved.micro_batch + 1)
        if option is None:
            continue
        if option["micro_batch"] != spec.micro_batch:
            label += f" + micro-batch {option['micro_batch']}"
        out.append({**option, "changes": label})
    if not out and sets:  # with more GPUs: checkpointing only
        label, saved = sets[0]
        option = _smallest_world_size(saved, gpu, budget)
        if option is not None:
            out.append({**option, "changes": f"{label} + {option['world_size']} GPUs"})
    return out


def smallest_fitting_setup(spec: TrainingSpec, gpu: GPU,
                           estimate: Callable[[TrainingSpec], Prediction],
                           job: Job | None = None) -> dict:
    """What makes `spec` fit `gpu`: as is; else the smallest world size (same sharding, or ZeRO-3
    if the job does not shard), the smallest higher ZeRO stage at this world size, and turning
    on gradient checkpointing, and the largest smaller micro-batch. `estimate` must price parallel
    specs (e.g. `predict`). Options that do not fit are None. Where neither more GPUs, a higher
    ZeRO stage nor checkpointing alone fits, `combined` is the best combination of savers and
    micro-batch (or savers and GPUs) within the probe budget (`_combined`), its `changes` in
    words. `job`: `spec` as resolved (`intake.resolve.ResolvedJob.spec`), whose decided
    precision the savers' checks read; without it they decide it (`_saver_sets`)."""
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
    out["combined"] = []
    if not any(out[k] for k in ("world_size", "zero_stage", "grad_ckpt")):
        out["combined"] = _combined(spec, gpu, estimate, job)
    return out
