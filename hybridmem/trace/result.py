"""From a finished trace to numbers: peak, breakdown at the peak, per-module memory, timeline."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hybridmem.categories import TENSOR_CATEGORIES
from hybridmem.prediction import ModuleMemory
from hybridmem.trace.model import part_of
from hybridmem.trace.tracker import StorageTracker, round_size

TIMELINE_POINTS = 2000  # max points kept in a timeline (max per bucket, so peaks survive)


@dataclass(slots=True, kw_only=True)
class TraceResult:
    """Everything a trace measured (allocated bytes, 512-rounded as the CUDA allocator does)."""

    events: list[tuple[str, int, int]]
    """("alloc", storage id, requested bytes) / ("free", storage id, 0), host storages left out."""
    curve: np.ndarray
    """Allocated bytes after each event of `events`."""
    peak_allocated: int
    peak_index: int
    """Index in `events` of the allocated peak."""
    peak_phase: str
    peak_iteration: int
    breakdown: dict[str, int]
    """Bytes per category (tensor categories + workspace) live at the peak."""
    by_phase: dict[str, int]
    """Bytes live at the peak by the phase ("forward 1", "optimizer 0", ...) that made them."""
    by_part: dict[str, int]
    """Bytes live at the peak by the top-level module whose forward made them ("other": none)."""
    modules: list[ModuleMemory]
    """Per top-level part: param/grad/optimizer bytes of the whole run, activation at the peak."""
    params_total: int
    params_trainable: int
    marks: list[tuple[int, str, int]]
    """(event index, phase, iteration) at each phase start."""
    peak_reserved: int | None = None
    """Simulated reserved peak (None when the allocator simulator is missing)."""
    reserved_curve: np.ndarray | None = None
    notes: list[str] = field(default_factory=list)

    def timeline(self, points: int = TIMELINE_POINTS) -> dict:
        """Bytes over events, down-sampled to at most `points` (max of each bucket)."""
        n = len(self.curve)
        step = max(1, -(-n // points))
        idx = np.arange(0, n, step)
        alloc = np.maximum.reduceat(self.curve, idx) if n else self.curve
        out = {"event": idx.tolist(), "allocated": alloc.tolist(),
               "phases": [{"event": e, "phase": p, "iteration": i} for e, p, i in self.marks],
               "peak": {"event": self.peak_index, "allocated": self.peak_allocated,
                        "reserved": self.peak_reserved, "phase": self.peak_phase,
                        "iteration": self.peak_iteration}}
        if self.reserved_curve is not None and n:
            out["reserved"] = np.maximum.reduceat(self.reserved_curve, idx).tolist()
        return out


def device_events(tracker: StorageTracker) -> list[tuple[str, int, int]]:
    """The alloc/free stream a CUDA device would see (host-side storages dropped)."""
    st = tracker.storages
    out = []
    for e in tracker.events:
        sid = e if e >= 0 else ~e
        if st[sid].category == "host":
            continue
        out.append(("alloc", sid, st[sid].nbytes) if e >= 0 else ("free", sid, 0))
    return out


def _curve(tracker: StorageTracker, events: list[tuple[str, int, int]]) -> np.ndarray:
    sizes = np.array([round_size(s.nbytes) for s in tracker.storages], dtype=np.int64)
    sid = np.fromiter((e[1] for e in events), dtype=np.int64, count=len(events))
    sign = np.fromiter((1 if e[0] == "alloc" else -1 for e in events), dtype=np.int64,
                       count=len(events))
    return np.cumsum(sign * sizes[sid]) if len(events) else np.zeros(0, dtype=np.int64)


def _live_at(tracker: StorageTracker, events, index: int) -> list[int]:
    live: set[int] = set()
    for kind, sid, _ in events[: index + 1]:
        if kind == "alloc":
            live.add(sid)
        else:
            live.discard(sid)
    return sorted(live)


def _modules(job, tracker: StorageTracker, live: list[int]) -> list[ModuleMemory]:
    """Per part: params (whole run) and activation bytes live at the peak."""
    acts: dict[str, int] = {}
    for sid in live:
        s = tracker.storages[sid]
        if s.category == "activation" and s.part is not None:
            acts[s.part] = acts.get(s.part, 0) + round_size(s.nbytes)
    rows: dict[str, dict[str, int]] = {}
    state_of = {id(p): st for p, st in job.optimizer.state.items()}
    masters = dict(zip((id(p) for _, p in job.trainable), job.masters))
    for name, p in job.model.named_parameters():
        part = part_of(name)
        row = rows.setdefault(part, {"params": 0, "trainable_params": 0, "param": 0, "grad": 0,
                                    "optimizer": 0, "activation": acts.get(part, 0)})
        row["params"] += p.numel()
        row["param"] += round_size(p.untyped_storage().nbytes())
        if p.requires_grad:
            row["trainable_params"] += p.numel()
            row["grad"] += round_size(job.grad_bytes.get(id(p), 0))
            stepped = masters.get(id(p), p)
            if stepped is not p:
                row["optimizer"] += round_size(stepped.untyped_storage().nbytes())
            for t in state_of.get(id(stepped), {}).values():
                if hasattr(t, "untyped_storage") and tracker.category_of(t) == "optimizer":
                    row["optimizer"] += round_size(t.untyped_storage().nbytes())
    return [ModuleMemory(name=part, **row) for part, row in rows.items()]


def summarize(tracker: StorageTracker, job) -> TraceResult:
    """Peak, breakdown and per-module memory of a finished trace."""
    events = device_events(tracker)
    curve = _curve(tracker, events)
    peak_index = int(np.argmax(curve))
    live = _live_at(tracker, events, peak_index)
    breakdown = {c: 0 for c in (*TENSOR_CATEGORIES, "workspace")}
    by_phase: dict[str, int] = {}
    by_part: dict[str, int] = {}
    for sid in live:
        s = tracker.storages[sid]
        size = round_size(s.nbytes)
        breakdown[s.category] += size
        key = s.phase if s.phase == "setup" else f"{s.phase} {s.iteration}"
        by_phase[key] = by_phase.get(key, 0) + size
        by_part[s.part or "other"] = by_part.get(s.part or "other", 0) + size
    # phase of the peak: the last mark at or before it, mapped from tracker to device events
    phase, iteration = tracker.phase_at(_tracker_index(tracker, events, peak_index))
    params = list(job.model.parameters())
    return TraceResult(
        events=events, curve=curve, peak_allocated=int(curve[peak_index]),
        peak_index=peak_index, peak_phase=phase, peak_iteration=iteration,
        breakdown=breakdown, by_phase=by_phase, by_part=by_part,
        modules=_modules(job, tracker, live),
        params_total=sum(p.numel() for p in params),
        params_trainable=sum(p.numel() for p in params if p.requires_grad),
        marks=_device_marks(tracker, events))


def _tracker_index(tracker: StorageTracker, events, device_index: int) -> int:
    """Index in tracker.events of device event `device_index`."""
    kind, sid, _ = events[device_index]
    s = tracker.storages[sid]
    return s.birth if kind == "alloc" else s.death


def _device_marks(tracker: StorageTracker, events) -> list[tuple[int, str, int]]:
    """Phase marks re-indexed onto the device event stream."""
    where = np.array([_tracker_index(tracker, events, i) for i in range(len(events))],
                     dtype=np.int64)
    return [(int(np.searchsorted(where, at)), p, i) for at, p, i in tracker.marks]
