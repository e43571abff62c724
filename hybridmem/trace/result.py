"""From a finished trace to numbers: peak, breakdown at the peak, per-module memory, timeline."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hybridmem.categories import TENSOR_CATEGORIES
from hybridmem.models.build import part_of
from hybridmem.prediction import ModuleMemory
from hybridmem.trace.tracker import OFF_ALLOCATOR, Storage, StorageTracker, round_size

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
    after_step_allocated: int | None = None
    """Allocated bytes right after the last `optimizer.step()`, before `zero_grad`: weights,
    grads, optimizer state and what the loop still holds (the published benchmarks' figure)."""
    peak_reserved: int | None = None
    """Simulated reserved peak (`hybridmem.allocator`), set by `run_trace` after `summarize`."""
    reserved_curve: np.ndarray | None = None
    """Simulated reserved bytes after each event of `events` (set with `peak_reserved`)."""
    allocator: object = None
    """What the simulated allocator went through (`allocator.reserved.Bounded`: retries, OOM,
    capacity), set with `peak_reserved`."""
    empty_cache_at: list[int] = field(default_factory=list)
    """Index in `events` before which `torch.cuda.empty_cache()` ran (`spec.empty_cache_at`)."""
    notes: list[str] = field(default_factory=list)
    paged: int = 0
    """Optimizer state in unified memory (bitsandbytes paged), raw bytes, off the allocator."""

    def replay_events(self) -> list[tuple[str, int, int]]:
        """`events` with ("empty_cache", 0, 0) inserted at `empty_cache_at`: the stream the
        allocator simulator replays (`events` itself stays aligned with `curve`)."""
        return with_empty_cache(self.events, self.empty_cache_at)

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


def device_positions(tracker: StorageTracker) -> np.ndarray:
    """Index in `tracker.events` of each event a CUDA device would see (host storages dropped)."""
    st = tracker.storages
    return np.array([j for j, e in enumerate(tracker.events)
                     if st[e if e >= 0 else ~e].category not in OFF_ALLOCATOR],
                    dtype=np.int64)


def device_events(tracker: StorageTracker, where: np.ndarray) -> list[tuple[str, int, int]]:
    """The alloc/free stream at `where` (`device_positions`), as the allocator simulator reads."""
    st = tracker.storages
    out = []
    for j in where.tolist():
        e = tracker.events[j]
        out.append(("alloc", e, st[e].nbytes) if e >= 0 else ("free", ~e, 0))
    return out


def with_empty_cache(events: list, at: list[int]) -> list:
    """`events` with ("empty_cache", 0, 0) inserted before each index in `at` (ascending;
    an index may repeat: two calls in a row)."""
    out, prev = [], 0
    for k in at:
        out += events[prev:k]
        out.append(("empty_cache", 0, 0))
        prev = k
    return out + events[prev:]


def _modules(job, category_of, live: list[Storage], weight: dict[str, int]
             ) -> list[ModuleMemory]:
    """Per part: params (whole run) and activation bytes live at the peak. `weight`: how many
    parameters of the full model a traced one stands for (the fast path's repeated layers)."""
    acts: dict[str, int] = {}
    for s in live:
        if s.category == "activation" and s.part is not None:
            acts[s.part] = acts.get(s.part, 0) + round_size(s.nbytes)
    rows: dict[str, dict[str, int]] = {}
    state_of = {id(p): st for p, st in job.optimizer.state.items()}
    masters = dict(zip((id(p) for _, p in job.trainable), job.masters))
    for name, p in job.model.named_parameters():
        part, w = part_of(name), weight.get(name, 1)
        row = rows.setdefault(part, {"params": 0, "trainable_params": 0, "param": 0, "grad": 0,
                                    "optimizer": 0, "activation": acts.get(part, 0)})
        row["params"] += w * p.numel()
        row["param"] += w * round_size(p.untyped_storage().nbytes())
        if p.requires_grad:
            row["trainable_params"] += w * p.numel()
            row["grad"] += w * round_size(job.grad_bytes.get(id(p), 0))
            stepped = masters.get(id(p), p)
            if stepped is not p:
                row["optimizer"] += w * round_size(stepped.untyped_storage().nbytes())
            for t in state_of.get(id(stepped), {}).values():
                if hasattr(t, "untyped_storage") and category_of(t) == "optimizer":
                    row["optimizer"] += w * round_size(t.untyped_storage().nbytes())
    for key, st in job.optimizer.state.items():
        if isinstance(key, str) and part_of(key) in rows:  # LoRA-FA: state keyed by name
            rows[part_of(key)]["optimizer"] += weight.get(key, 1) * sum(
                round_size(t.untyped_storage().nbytes()) for t in st.values()
                if hasattr(t, "untyped_storage") and category_of(t) == "optimizer")
    out = [ModuleMemory(name=part, **row) for part, row in rows.items()]
    return out + _objective_rows(job, live)


def _objective_rows(job, live: list[Storage]) -> list[ModuleMemory]:
    """The objective's own lines (`hybridmem.objectives.steps`): "reference" (a separate copy's
    parameters) and "generation" (GRPO), each with the activation-category bytes of its part
    live at the peak as the other lines count them (what their forwards hold otherwise is
    temporary: `Prediction.extras["objective"]` gives those bytes)."""
    held: dict[str, int] = {}
    for s in live:
        if s.part in ("reference", "generation") and s.category == "activation":
            held[s.part] = held.get(s.part, 0) + round_size(s.nbytes)
    out = []
    ref = getattr(job, "ref", None)
    if ref is not None or "reference" in held:
        params = list(ref.parameters()) if ref is not None else []
        out.append(ModuleMemory(
            name="reference", params=sum(p.numel() for p in params), trainable_params=0,
            param=sum(round_size(p.untyped_storage().nbytes()) for p in params), grad=0,
            optimizer=0, activation=held.get("reference", 0)))
    if getattr(job, "generated", False) or "generation" in held:
        out.append(ModuleMemory(name="generation", params=0, trainable_params=0, param=0,
                                grad=0, optimizer=0, activation=held.get("generation", 0)))
    return out


def _numel(p) -> int:
    """Elements of a parameter as the model counts them (a packed 4-bit weight: its logical
    shape's, `hybridmem.trace.quantized.Linear4bit`)."""
    return getattr(p, "logical_numel", None) or p.numel()


def summarize(tracker: StorageTracker, job, *, weight: dict[str, int] | None = None,
              after_step: list[int] | None = None, category_of=None) -> TraceResult:
    """Peak, breakdown and per-module memory of a finished trace. The fast path
    (`repeat.trace`) passes the full stream as `tracker` with the short model's `job`:
    `weight` (parameter name -> how many it stands for), `after_step` (indices on the full
    stream), `category_of` (the short trace's labels of `job`'s tensors)."""
    weight = {} if weight is None else weight
    after_step = getattr(job, "after_step", None) if after_step is None else after_step
    category_of = tracker.category_of if category_of is None else category_of
    where = device_positions(tracker)
    full = tracker.live_curve()
    curve = full[where]  # host storages count 0 there
    peak_index = int(np.argmax(curve))
    at = int(where[peak_index])  # the peak's index in tracker.events
    live = [s for s in tracker.live_at(at) if s.category not in OFF_ALLOCATOR]
    breakdown = {c: 0 for c in (*TENSOR_CATEGORIES, "workspace")}
    by_phase: dict[str, int] = {}
    by_part: dict[str, int] = {}
    for s in live:
        size = round_size(s.nbytes)
        breakdown[s.category] += size
        key = s.phase if s.phase == "setup" else f"{s.phase} {s.iteration}"
        by_phase[key] = by_phase.get(key, 0) + size
        by_part[s.part or "other"] = by_part.get(s.part or "other", 0) + size
    phase, iteration = tracker.phase_at(at)
    params = list(job.model.named_parameters())
    return TraceResult(
        events=device_events(tracker, where), curve=curve,
        peak_allocated=int(curve[peak_index]),
        peak_index=peak_index, peak_phase=phase, peak_iteration=iteration,
        breakdown=breakdown, by_phase=by_phase, by_part=by_part,
        modules=_modules(job, category_of, live, weight),
        params_total=sum(weight.get(n, 1) * _numel(p) for n, p in params),
        params_trainable=sum(weight.get(n, 1) * _numel(p) for n, p in params if p.requires_grad),
        # phase marks re-indexed onto the device event stream
        marks=[(int(np.searchsorted(where, m)), p, i) for m, p, i in tracker.marks],
        empty_cache_at=[int(np.searchsorted(where, k)) for k in tracker.empty_caches],
        # unified-memory state, raw bytes (made in the first step, alive to the end)
        paged=sum(s.nbytes for s in tracker.storages if s.category == "paged"),
        after_step_allocated=int(full[after_step[-1]]) if after_step else None,
        notes=list(getattr(job, "notes", ())))
