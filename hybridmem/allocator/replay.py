"""Replay alloc/free streams and real `torch.cuda.memory._snapshot()` traces through the simulator.

`replay` drives a `CachingAllocatorSim` with the tracker's event stream. `replay_snapshot` drives
it with the `alloc` / `free_completed` entries that the real allocator recorded
(`record_trace` in CUDACachingAllocator.cpp) and, from the same trace, rebuilds the REAL reserved
curve from `segment_alloc` / `segment_free` / `segment_map` / `segment_unmap`, so the two can be
compared on one stream once real CUDA traces exist (`hybridmem collect` records them).

Trace entries carry what `record_trace` was given: `alloc` the requested size at the block's
address, `free_completed` the block's requested size, `segment_*` the segment or mapped range.
History started after the first allocations leaves frees without a matching alloc; they are
counted (`unmatched_frees`) and skipped, and the real curve starts from the reserved bytes
implied by the snapshot's `segments` minus the trace's net change.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hybridmem.errors import SpecError
from hybridmem.allocator.config import AllocatorConfig
from hybridmem.allocator.sim import CachingAllocatorSim

_SEGMENT_DELTA = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
            "segment_map", "segment_unmap", "oom", "snapshot", "user_defined")


@dataclass(slots=True, kw_only=True)
class ReplayResult:
    """Peaks of a replayed stream; `real_*` only when replaying a real trace."""

    peak_allocated: int
    """Simulated `max_memory_allocated`: rounded block sizes."""
    peak_reserved: int
    """Simulated `max_memory_reserved`: segments (or mapped pages)."""
    peak_requested: int
    """Sum of live requested sizes at its peak (`requested_bytes`)."""
    timeline: list[tuple[int, int, int]] = field(default_factory=list)
    """(event index, allocated, reserved) after each alloc/free."""
    num_alloc_retries: int = 0
    num_ooms: int = 0
    num_device_alloc: int = 0
    """cudaMalloc / cuMemMap calls the simulator made."""
    real_peak_reserved: int | None = None
    real_peak_requested: int | None = None
    real_num_device_alloc: int | None = None
    real_timeline: list[tuple[int, int, int]] | None = None
    """(trace index, requested, reserved) of the real allocator, after each entry."""
    unmatched_frees: int = 0
    """Frees whose allocation the stream (or trace) never showed; skipped."""

    @property
    def reserved_error(self) -> float | None:
        """(simulated - real) / real peak reserved, when a real trace was replayed."""
        if not self.real_peak_reserved:
            return None
        return (self.peak_reserved - self.real_peak_reserved) / self.real_peak_reserved


def replay(events: Iterable[tuple], config: AllocatorConfig = AllocatorConfig(), *,
           capacity: int | None = None, timeline: bool = True) -> ReplayResult:
    """Feed ("alloc", key, size) / ("free", key, 0) events (optionally a 4th item: stream).

    ("empty_cache", 0, 0) calls `torch.cuda.empty_cache()`. Keys are any hashable caller ids;
    a free of a key never allocated is counted in `unmatched_frees` and skipped.
    `timeline=False`: peaks and counters only (the result's `timeline` stays empty).
    """
    sim = CachingAllocatorSim(config, capacity=capacity)
    live: dict = {}
    points: list = []
    append = points.append
    unmatched = 0
    for index, event in enumerate(events):
        action = event[0]
        if action == "alloc":
            live[event[1]] = sim.malloc(event[2], event[3] if len(event) > 3 else 0)
        elif action == "free":
            addr = live.pop(event[1], None)
            if addr is None:
                unmatched += 1
            else:
                sim.free(addr)
        elif action == "empty_cache":
            sim.empty_cache()
        else:
            raise SpecError("event", action, ("alloc", "free", "empty_cache"))
        if timeline:
            append((index, sim.allocated, sim.reserved))
    return _result(sim, points, unmatched_frees=unmatched)


def peak_requested(events: Iterable[tuple]) -> int:
    """Peak of the live requested bytes of a ("alloc" / "free", key, size) stream: `replay`'s
    `peak_requested` without simulating the allocator (what its allocated and reserved peaks
    can never fall below)."""
    live: dict = {}
    pop = live.pop
    now = top = 0
    for event in events:
        action = event[0]
        if action == "alloc":
            live[event[1]] = size = event[2]
            now += size
            if now > top:
                top = now
        elif action == "free":
            now -= pop(event[1], 0)
    return top


def _result(sim: CachingAllocatorSim, timeline: list, **real) -> ReplayResult:
    return ReplayResult(
        peak_allocated=sim.peak_allocated, peak_reserved=sim.peak_reserved,
        peak_requested=sim.peak_requested, timeline=timeline,
        num_alloc_retries=sim.num_alloc_retries, num_ooms=sim.num_ooms,
        num_device_alloc=sim.num_device_alloc, **real)


def _device_trace(snapshot: Mapping, device: int) -> list[Mapping]:
    traces = snapshot.get("device_traces")
    if not isinstance(traces, list) or not 0 <= device < len(traces):
        n = len(traces) if isinstance(traces, list) else 0
        raise SpecError("device", device, range(n) if n else None,
                        reason="snapshot has no device_traces for this device "
                               "(record with torch.cuda.memory._record_memory_history first)")
    return traces[device]


def _final_state(snapshot: Mapping, device: int) -> tuple[int, int]:
    """Reserved and requested bytes at snapshot time, from `segments` (the state dump)."""
    reserved = requested = 0
    for seg in snapshot.get("segments", ()):
        if seg.get("device", 0) != device:
            continue
        reserved += seg["total_size"]
        for block in seg.get("blocks", ()):
            if str(block.get("state", "")).startswith("active"):
                requested += block.get("requested_size", block.get("size", 0))
    return reserved, requested


def replay_snapshot(snapshot: Mapping, device: int = 0,
                    config: AllocatorConfig | None = None) -> ReplayResult:
    """Replay `snapshot["device_traces"][device]` and set the real curve beside the simulated one.

    `config=None` uses PyTorch's defaults, with expandable segments on when the trace has
    `segment_map` entries. A run of `segment_free` / `segment_unmap` entries (empty_cache or the
    OOM retry path) makes the simulator run `empty_cache` too.
    """
    trace = _device_trace(snapshot, device)
    if config is None:
        expandable = any(e.get("action") in ("segment_map", "segment_unmap") for e in trace)
        config = AllocatorConfig(expandable_segments=expandable)
    sim = CachingAllocatorSim(config)
    live: dict[int, int] = {}
    timeline, real = [], []
    reserved = requested = segment_allocs = unmatched = 0
    previous = None
    for index, entry in enumerate(trace):
        action = entry.get("action")
        if action not in _ACTIONS:
            raise SpecError("action", action, _ACTIONS, reason=f"unknown trace entry {index}")
        if action == "alloc":
            live[entry["addr"]] = sim.malloc(entry["size"], entry.get("stream", 0))
            requested += entry["size"]
        elif action == "free_completed":
            handle = live.pop(entry["addr"], None)
            requested -= entry["size"]
            if handle is None:
                unmatched += 1
            else:
                sim.free(handle)
        elif action in _SEGMENT_DELTA:
            sign = _SEGMENT_DELTA[action]
            reserved += sign * entry["size"]
            segment_allocs += sign > 0
            if sign < 0 and previous not in ("segment_free", "segment_unmap"):
                sim.empty_cache()
        else:
            previous = action
            continue
        previous = action
        timeline.append((index, sim.allocated, sim.reserved))
        real.append((index, requested, reserved))
    final_reserved, final_requested = _final_state(snapshot, device)
    base_reserved = final_reserved - reserved if snapshot.get("segments") is not None else 0
    base_requested = final_requested - requested if snapshot.get("segments") is not None else 0
    base_reserved, base_requested = max(base_reserved, 0), max(base_requested, 0)
    real = [(i, q + base_requested, r + base_reserved) for i, q, r in real]
    return _result(
        sim, timeline,
        real_peak_reserved=max((r for _, _, r in real), default=base_reserved),
        real_peak_requested=max((q for _, q, _ in real), default=base_requested),
        real_num_device_alloc=segment_allocs, real_timeline=real, unmatched_frees=unmatched)
