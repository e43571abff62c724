"""Advice over layouts: for a GPU count and a GPU, every (dp, tp, pp, cp) layout of the job
that fits, sorted by headroom, with each one's per-rank peak, and the smallest GPU count that
fits at all.

Which layouts are tried, and why: the degrees that divide the GPU count and the model
(`layout.check_layout`: heads, KV heads, intermediate size, layers, sequence); tensor
parallelism only up to 8 ranks (one NVLink node: Megatron-LM's and torchtitan's guidance keep
TP inside a node) with sequence parallelism on (torchtitan's default with TP); pipelines with
1F1B and `max(pp, the job's micro-batches)` micro-batches; the data-parallel ranks with the
job's sharding strategy (ZeRO or FSDP), else FSDP2. Every layout is priced by the analytic per-rank
tier (`parallel.ranks`, `parallel.estimate`), which shares its narrow-model pricing between
layouts of the same tp and cp.
"""

from __future__ import annotations

import dataclasses

from hybridmem.errors import SpecError
from hybridmem.gpus import GPU
from hybridmem.job.parallel import ParallelSpec
from hybridmem.job.spec import TrainingSpec
from hybridmem.parallel.layout import check_layout, model_shape

SHARDED = ("zero1", "zero2", "zero3", "fsdp")
"""Data-parallel strategies a layout keeps; any other (DDP, the default) is advised as FSDP2."""
MAX_TP = 8
"""Largest tensor-parallel degree tried (one node of 8 GPUs)."""
MAX_GPUS = 4096
"""Largest GPU count the smallest-fit search goes to (powers of two)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(spec: TrainingSpec, gpus: int) -> list[ParallelSpec]:
    """The layouts of `gpus` ranks the model divides (module docstring)."""
    from hybridmem.models.loader import load_config_dict

    shape = model_shape(load_config_dict(spec.model)[1])
    base = spec.parallel
    out = []
    for tp in (d for d in _divisors(gpus) if d <= MAX_TP):
        for pp in _divisors(gpus // tp):
            for cp in _divisors(gpus // (tp * pp)):
                dp = gpus // (tp * pp * cp)
                strategy = base.strategy if base.strategy in SHARDED else "fsdp"
                m = max(pp, base.pp_microbatches or 1) if pp > 1 else None
                try:
                    ps = dataclasses.replace(
                        base, world_size=gpus, tp=tp, cp=cp, pp=pp, ep=1, dp_replicate=1,
                        dp_shard=None, sequence_parallel=tp > 1, pp_schedule="1f1b",
                        pp_virtual_stages=1, pp_microbatches=m,
                        strategy=strategy if dp > 1 else "none")
                    check_layout(ps, shape, spec.seq_len)
                except SpecError:
                    continue
                out.append(ps)
    return out


def _price(spec: TrainingSpec, gpu: GPU) -> tuple[int, int]:
    """(device peak, highest pipeline rank) of one layout, analytic; a GPU too small to hold
    even what a rank keeps outside PyTorch's allocator (`rank_capacity`) fits nothing."""
    from hybridmem.analytic import estimate as analytic
    from hybridmem.parallel.estimate import analytic_points, analytic_ranks, per_rank_aware

    price = per_rank_aware(analytic, points=analytic_points, model_parallel=analytic_ranks)
    try:
        pred = price(spec, gpu=gpu)
    except SpecError as err:
        if err.field != "gpu":
            raise
        return gpu.memory_bytes + 1, 0
    return pred.peak.device_bytes, pred.extras.get("highest_rank", 0)


def advise(spec: TrainingSpec, gpus: int, gpu: GPU, *, all_layouts: bool = False) -> dict:
    """{"rows": one per layout (fitting ones first, by headroom), "smallest_gpus": the fewest
    GPUs (a power of two) with a layout that fits, or None}."""
    rows = []
    for ps in candidates(spec, gpus):
        peak, rank = _price(spec.with_(parallel=ps), gpu)
        rows.append({"dp": ps.data_parallel, "tp": ps.tp, "pp": ps.pp, "cp": ps.cp,
                     "strategy": ps.strategy, "sequence_parallel": ps.sequence_parallel,
                     "pp_microbatches": ps.microbatches if ps.pp > 1 else None,
                     "peak_bytes": peak, "headroom_bytes": gpu.memory_bytes - peak,
                     "fits": peak <= gpu.memory_bytes, "highest_pp_rank": rank})
    rows.sort(key=lambda r: -r["headroom_bytes"])
    if not all_layouts:
        rows = [r for r in rows if r["fits"]] or rows[:3]
    return {"gpus": gpus, "gpu": gpu.name, "rows": rows,
            "smallest_gpus": smallest_gpus(spec, gpu)}


def smallest_gpus(spec: TrainingSpec, gpu: GPU) -> int | None:
    """The fewest GPUs (powers of two up to `MAX_GPUS`) with a layout that fits `gpu`. Doubling
    the GPUs of a fitting layout along dp shards its states further, so whether some layout
    of n GPUs fits is monotone in n: a bisection over the powers of two finds the first."""
    powers = [2**k for k in range(MAX_GPUS.bit_length())]
    def fits(n: int) -> bool:
        return any(_price(spec.with_(parallel=ps), gpu)[0] <= gpu.memory_bytes
                   for ps in candidates(spec, n))
    if not fits(powers[-1]):
        return None
    lo, hi = 0, len(powers) - 1  # fits(powers[hi]) holds
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(powers[mid]):
            hi = mid
        else:
            lo = mid + 1
    return powers[hi]
