"""Reserved - allocated bytes (fragmentation) from replaying `events.build`'s stream through
the caching-allocator simulator (`hybridmem.allocator`, shared with the trace tier).

Only the difference is taken from the replay: the allocated peak stays the closed form's
(the simulator's allocated peak differs slightly, e.g. it keeps <= 1 MiB remainders of split
blocks unsplit). The difference is `peak_reserved - peak_allocated` of the replay, the same
definition as the trace tier's `fragmentation` (`hybridmem.trace.estimate`).

With a `capacity` (bytes the allocator may reserve on the target GPU,
`overheads.allocator_capacity`) the stream is replayed as PyTorch runs it at the GPU's limit:
a failed cudaMalloc makes the allocator free its cached blocks and retry
(`DeviceCachingAllocator::malloc`, counted in `num_alloc_retries`) before it raises OOM. A
replay that completes then never reserves more than the capacity; one that OOMs is replayed
again without a limit (its reserved peak then exceeds the capacity: a stream whose unlimited
peak fits never reaches the limit), so "does not fit" keeps the size of the shortfall.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from hybridmem.allocator.config import AllocatorConfig, alloc_conf_string
from hybridmem.allocator.replay import ReplayResult, peak_requested, replay
from hybridmem.allocator.sim import SimulatedOOM
from hybridmem.allocator.overheads import CUDA_CONTEXT_DEFAULT, allocator_capacity
from hybridmem.errors import SpecError
from hybridmem.gpus import GPU
from hybridmem.objectives import at_micro_batch

# CARRY = 1 / CARRY_DIV: how much of a smaller micro-batch's device bytes carries over to a
# larger one's, per byte of allocated growth. 1 would carry its whole fragmentation (always
# conservative), 0 assumes the larger batch's new tensors fit in the smaller one's spare
# segments (device bytes then stop growing with the batch). Neither is measured; 1/2 is the
# midpoint, and on the large configs of experiments/analytic_vs_trace.py the estimate equals
# the replay at the spec's own micro-batch.
CARRY_DIV = 2


def fragmentation(events, config=None) -> tuple[int, int, int]:
    """(peak reserved - peak allocated, peak reserved, peak allocated) of the replayed stream
    (`hybridmem.allocator.replay`). `config`: by default the one PYTORCH_ALLOC_CONF /
    PYTORCH_CUDA_ALLOC_CONF give (`AllocatorConfig.from_environ`)."""
    result = replay(events, config if config is not None else AllocatorConfig.from_environ())
    return (result.peak_reserved - result.peak_allocated, result.peak_reserved,
            result.peak_allocated)


def capped_replay(events, config: AllocatorConfig, capacity: int | None
                  ) -> tuple[ReplayResult, bool]:
    """(replay, ran out of memory): the stream replayed within `capacity` (None: unlimited).
    On a simulated OOM the unlimited replay is returned, flagged, so that its peak (above
    the capacity) says by how much the job misses."""
    if capacity is not None:
        try:
            return replay(events, config, capacity=capacity), False
        except SimulatedOOM:
            pass
    return replay(events, config), capacity is not None


@dataclass(frozen=True, slots=True)
class Bounded:
    """What `bounded` found: the fragmentation to report and how the allocator got there."""

    fragmentation: int
    retries: int = 0
    """Largest `num_alloc_retries` among the replays at or below the spec's micro-batch: > 0
    means the job fits only because the allocator released its cache at the GPU's limit
    (slower)."""
    oom_batches: tuple[int, ...] = ()
    """Micro-batches at or below the spec's whose replay ran out of memory within the
    capacity (the estimate's reserved bytes then exceed it: the job does not fit)."""
    capacity: int | None = None
    over_capacity: bool = False
    """The answer's reserved bytes exceed the capacity: the allocator runs out of memory at the
    spec's micro-batch (a replay at or below it did, or the estimate between the replayed
    micro-batches lands above the capacity). Set by whoever computes the answer's reserved
    bytes (`bounded`, the trace tier, a rank's estimate)."""
    probe_oom: bool = False
    """The replay at the next power of two (the 2q probe of `bounded`) ran out of memory."""
    uncapped: int | None = None
    """Where the allocator retried at the capacity and so reserves less than without a limit:
    the reserved estimate without one (the GPU-less answer's), set by the tier that computes
    both (`analytic.estimate`); None otherwise. The notes say both."""

    @property
    def oom(self) -> bool:
        """The JSON `allocator.oom`: the job runs out of memory on the GPU."""
        return self.over_capacity

    @property
    def completed(self) -> bool:
        """Every replay the estimate rests on (the 2q probe included) ran within the capacity."""
        return not self.oom_batches and not self.probe_oom


def envelope(spec, allocated: int, measure: Callable) -> int:
    """`bounded(...).fragmentation` without a capacity (the GPU-less answer)."""
    return bounded(spec, allocated, measure).fragmentation


def bounded(spec, allocated: int, measure: Callable, capacity: int | None = None) -> Bounded:
    """Fragmentation for `spec`, such that device bytes never shrink as the micro-batch grows.

    The replayed fragmentation F(b) is not monotone in the micro-batch b, and neither is the
    trace tier's (segment reuse is discrete: llava-1.5-7b bf16 flash-attention gives 5.6, 1.6,
    11.4, 1.5 GiB at b = 1..4; the trace tier 3.6, 1.9, 12.3, 2.2 GiB), but `--find-max-batch`
    bisects on device bytes (and they should grow with it). With D(p) = allocated(p) + F(p)
    and q the largest power of two <= b, the estimate of reserved bytes is
        max( max over powers of two p <= q of D(p) + CARRY * (allocated(b) - allocated(p)),
             allocated(b) + min(F(q), F(2q)) )
    Non-decreasing in b (strictly where allocated grows): within [q, 2q) both terms grow
    with allocated(b); at b = 2q the first term gains D(2q) = allocated(2q) + F(2q), which
    bounds every earlier second term. At a power of two it is D(b) unless a smaller power had
    more device bytes (then about that, as find-max-batch needs). Cost: log2(b) + 1 replays,
    + 1 when b is not a power of two; each is cached.
    `measure(spec)` returns (closed-form allocated peak, event stream) of a spec.

    With a `capacity` every replay runs within it (`capped_replay`: F of a replay that fits
    is at most capacity - its allocated; one that OOMs keeps its unlimited F). The formula
    above is non-decreasing for any F, so it stays monotone. When no replay ran out of
    memory, reserved is then also capped at the capacity (at least `allocated`): the carry
    term may exceed it, but an allocator that completes the stream never holds more than
    it may reserve, its cache having been released instead. Still monotone: the replayed
    micro-batches ({1, 2, .., q}, plus 2q when b is not a power of two) only gain members as b
    grows, so once one OOMs every larger b keeps the uncapped (larger) figure. A replay at
    <= b that OOMs also floors reserved at its own (unlimited) reserved peak, above the
    capacity, so "ran out of memory" and "fits" never both hold; the 2q probe's OOM or
    retries are not b's (it only bounds the estimate)."""
    env = alloc_conf_string()  # the cache key: AllocatorConfig itself may not hash
    _config(env)  # a malformed PYTORCH_ALLOC_CONF raises its SpecError here
    b = spec.micro_batch
    q = 1 << (b.bit_length() - 1)
    device = allocated
    retries, ooms, above = 0, [], []
    floor = 0  # the largest reserved peak of a replay at <= b that ran out of memory

    def at(batch: int, default: int = 0) -> tuple[int, int]:
        nonlocal retries, floor
        a, f, r, oom, peak = at_batch(spec, batch, measure, env, capacity, default)
        if batch > b:  # the 2q probe: it bounds the estimate, its allocator events are not b's
            above.extend([batch] if oom else [])
            return a, f
        retries = max(retries, r)
        if oom:
            ooms.append(batch)
            floor = max(floor, peak)
        return a, f

    for j in range(q.bit_length()):
        a, f = at(1 << j)
        if a:
            device = max(device, a + f + (allocated - a) // CARRY_DIV)
    if b != q:
        f_q = at(q)[1]
        f_2q = at(2 * q, default=f_q)[1]
        device = max(device, allocated + min(f_q, f_2q))
    # capped only where the closed form's tensors fit too: a stream that leaves out tensors
    # the closed form counts (an approximation of `events.build`) can complete a replay the
    # job cannot, and the peak is then the unlimited one, whatever GPU is asked about
    if capacity is not None and not ooms and not above and allocated <= capacity:
        device = max(allocated, min(device, capacity))
    # a replay at <= b that ran out of memory reserved more than the capacity (its unlimited
    # peak): the job at b, at least as large, does not fit either, whatever the closed form's
    # allocated bytes (which can sit below the stream's) add up to
    device = max(device, floor)
    return Bounded(device - allocated, retries, tuple(ooms), capacity,
                   over_capacity=capacity is not None and device > capacity,
                   probe_oom=bool(above))


def at_batch(spec, batch: int, measure: Callable, env: str, capacity: int | None = None,
        default: int = 0) -> tuple[int, int, int, bool, int]:
    """(allocated, F, retries, OOM, reserved peak) at another micro-batch; a batch the spec
    rejects counts as (0, default, 0, False, 0)."""
    try:
        other = at_micro_batch(spec, batch)  # GRPO: a group size the batch splits into
    except SpecError:
        return 0, default, 0, False, 0
    return _replayed(other, measure, env, capacity)


def _config(env: str) -> AllocatorConfig:
    return AllocatorConfig.from_env(env)


_REPLAYS: dict[tuple, tuple[int, int, int, bool, int, int]] = {}
"""(spec, measure, env, capacity) -> `_replay_summary`: a process replays each stream once
(`--find-max-batch` and `--gpu`'s advice ask for the same micro-batches many times)."""
_REPLAYS_MAX = 128  # entries kept (oldest dropped first): a bound on memory, not a tuned figure
_REPLAYS_LOCK = threading.Lock()


def _replayed(spec, measure: Callable, env: str, capacity: int | None = None
              ) -> tuple[int, int, int, bool, int]:
    """(allocated, F, num_alloc_retries, ran out of memory, peak reserved) of `spec`'s
    replayed stream."""
    return _replay_summary(spec, measure, env, capacity)[:5]


def _replay_summary(spec, measure: Callable, env: str, capacity: int | None,
                    measured: tuple[int, list] | None = None
                    ) -> tuple[int, int, int, bool, int, int]:
    """`_replayed` plus the stream's peak of live requested bytes. Within a `capacity`, two
    outcomes are known without replaying there: live tensors above it run out of memory (the
    allocator's reserved bytes never fall below the requested ones, and stay within the
    capacity when it completes), and a stream whose unlimited replay reserves no more than it
    never meets it (the same replay, no retry) unless expandable segments or a garbage
    collection threshold make the capacity matter before it is reached
    (`sim.CachingAllocatorSim`: its address space, its collection threshold)."""
    key = (spec, measure, env, capacity)
    hit = _REPLAYS.get(key)
    if hit is not None:
        return hit
    config = _config(env)
    unlimited = _REPLAYS.get((spec, measure, env, None))
    if capacity is not None and unlimited is None:
        measured = measured or measure(spec)
        if peak_requested(measured[1]) > capacity:
            unlimited = _replay_summary(spec, measure, env, None, measured)
    if capacity is not None and unlimited is not None:
        allocated, fragmentation, _, _, peak, requested = unlimited
        if requested > capacity:  # as `capped_replay`: the unlimited replay, flagged
            return _keep(key, (allocated, fragmentation, 0, True, peak, requested))
        if peak <= capacity and not (config.expandable_segments
                                     or config.garbage_collection_threshold):
            return _keep(key, unlimited)
    allocated, events = measured or measure(spec)
    try:
        result = replay(events, config, capacity=capacity, timeline=False)
    except SimulatedOOM:  # as `capped_replay`: the unlimited replay (kept too), flagged
        allocated, fragmentation, retries, _, peak, requested = _replay_summary(
            spec, measure, env, None, (allocated, events))
        return _keep(key, (allocated, fragmentation, retries, True, peak, requested))
    return _keep(key, (allocated, result.peak_reserved - result.peak_allocated,
                       result.num_alloc_retries, False, result.peak_reserved,
                       result.peak_requested))


def _keep(key: tuple, value: tuple) -> tuple:
    with _REPLAYS_LOCK:  # a server may answer from several threads
        if len(_REPLAYS) >= _REPLAYS_MAX:
            del _REPLAYS[next(iter(_REPLAYS))]
        _REPLAYS[key] = value
    return value


def capacity_notes(fit: Bounded, allocated: int, outside: str) -> list[str]:
    """The `notes` lines of a replay within a GPU's capacity (`outside`: what was subtracted
    from the GPU's memory to get it, in words)."""
    if fit.capacity is None:
        return []
    notes = [f"allocator capacity: {fit.capacity} bytes = {outside}; the stream is replayed "
             "within it, as PyTorch's caching allocator frees its cache and retries when "
             "cudaMalloc fails"]  # CUDACachingAllocator.cpp DeviceCachingAllocator::malloc
    tensors = ("the tensors alone (allocated) exceed it" if allocated > fit.capacity else
               "the tensors alone (allocated) would fit: fragmentation is what misses")
    if fit.oom and fit.oom_batches:
        notes.append("does not fit: the simulated allocator runs out of memory even after "
                     "releasing its cached blocks (micro-batch "
                     f"{', '.join(map(str, fit.oom_batches))}); {tensors}; reserved is the "
                     "unlimited replay's")
    elif fit.oom:
        notes.append("does not fit: the estimate's reserved bytes exceed the capacity, though "
                     "the replays at or below this micro-batch complete within it; "
                     f"{tensors}")
    elif fit.retries:
        notes.append(f"fits only after the allocator released its cache: {fit.retries} "
                     "cudaMalloc retr" + ("y" if fit.retries == 1 else "ies") +
                     " (num_alloc_retries) over the replayed iterations, each freeing every "
                     "cached segment (cudaFree synchronizes the device): it fits, with allocator "
                     "retries that cost time" + held_note(fit))
    return notes


def held_note(fit: Bounded) -> str:
    """Where the allocator's behaviour at the capacity changes the peak: reserved held at the
    capacity, and what it reaches without the limit (the GPU-less answer's figure)."""
    if fit.uncapped is None:
        return ""
    return (f"; releasing its cache there, the allocator reserves less than the "
            f"{fit.uncapped / (1 << 30):.2f} GiB it would without the GPU's limit (the tensors "
            "are the same)")


FROM_GPU = "gpu"
"""`capacity=` default: the allocator's capacity on `gpu` (`overheads.allocator_capacity`)."""


def gpu_capacity(gpu: GPU | None, capacity: int | str | None) -> int | None:
    """The capacity a tier replays with: `capacity` as given, or with `FROM_GPU` the GPU's
    memory minus the CUDA context (None without a GPU: unlimited, the GPU-less answer)."""
    if capacity != FROM_GPU:
        return capacity
    return allocator_capacity(gpu) if gpu is not None else None


def capacity_source(gpu: GPU | None, outside: int = CUDA_CONTEXT_DEFAULT) -> str:
    """How a capacity was obtained, for the notes."""
    name = gpu.name if gpu is not None else "the GPU"
    return (f"{name}'s memory minus {outside >> 20} MiB outside PyTorch's allocator (CUDA "
            "context, overheads.CUDA_CONTEXT_DEFAULT)")


def allocator_extras(fit) -> dict:
    """The JSON `allocator` object of a replay within a capacity (none without one, so the
    GPU-less answer is unchanged)."""
    if fit.capacity is None:
        return {}
    out = {"capacity_bytes": fit.capacity, "num_alloc_retries": fit.retries, "oom": fit.oom}
    if getattr(fit, "uncapped", None) is not None:
        out["uncapped_reserved_bytes"] = fit.uncapped
    return {"allocator": out}
