"""The simulated run: each distinct batch shape priced, the per-step streams composed and
replayed through the allocator simulator.

One mechanism for every tier: a tier gives, per shape, its allocated peak and its alloc/free
stream of two iterations with phase marks (the analytic tier builds it from its closed forms,
`analytic.estimate.shape_stream`; the trace tier records it, `trace.run_trace`, once per shape; the
hybrid tier's stream is the analytic one). A stream splits at iteration 1's first forward:
setup + iteration 0 open the run (the first step's shape: parameters, the lazily created
optimizer state), and each later step appends iteration 1 of its own shape. Tensors one
iteration hands to the next (a custom loop's output object) are matched by allocation order:
the step's frees of what its own iteration 0 made free what the previous step left; frees of
setup tensors free the run's setup tensors of the same key.

Steps whose (previous shape, shape) pair was already replayed are skipped in the replay (they
take the reserved bytes reached so far): at most (shapes + 1)^2 steps are replayed, whatever the
run's length, and a run of one shape replays exactly the tier's own two iterations, so its
answer is the fixed-length one. docs/lengths.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hybridmem.allocator import AllocatorConfig, CachingAllocatorSim, SimulatedOOM
from hybridmem.allocator.reserved import FROM_GPU, gpu_capacity
from hybridmem.allocator.overheads import CUBLAS_WORKSPACE_BYTES, cublas_workspace
from hybridmem.batches.read import read_lengths
from hybridmem.batches.scope import steps_gap
from hybridmem.batches.steps import Shape, plan
from hybridmem.errors import SpecError
from hybridmem.gpus import GPU
from hybridmem.job.resolved import Job
from hybridmem.job.spec import TrainingSpec, empty_cache_at
from hybridmem.prediction import Prediction

SERIES_POINTS = 200
"""Per-step series in the JSON: at most this many points (the max of each run of steps)."""


@dataclass(frozen=True)
class ShapeStream:
    """A tier's view of one batch shape."""

    allocated: int
    """The tier's allocated peak at this shape."""
    events: list
    """("alloc", key, size) / ("free", key, 0) / ("empty_cache", 0, 0) of two iterations."""
    start0: int
    """Index of iteration 0's first forward (after setup)."""
    start1: int
    """Index of iteration 1's first forward."""


def _start(marks, iteration: int) -> int:
    return min(i for i, phase, it in marks if it == iteration and phase == "forward")


def shape_stream(method: str, spec: TrainingSpec, workspace: int = CUBLAS_WORKSPACE_BYTES
                 ) -> ShapeStream:
    """The allocated peak and stream of `spec` as tier `method` makes them."""
    if method == "trace":
        from hybridmem.trace import run_trace

        result = run_trace(spec, workspace=workspace)
        at = result.empty_cache_at
        # marks index `events`; the replayed stream has an empty_cache entry before each `at`
        marks = [(m + sum(k <= m for k in at), p, i) for m, p, i in result.marks]
        return ShapeStream(result.peak_allocated, result.replay_events(), _start(marks, 0),
                           _start(marks, 1))
    from hybridmem.analytic.estimate import shape_stream as analytic_stream

    allocated, events, marks = analytic_stream(spec, workspace)
    return ShapeStream(allocated, events, _start(marks, 0), _start(marks, 1))


@dataclass
class _Split:
    """A stream cut for composition."""

    prefix: list
    segment: list
    carry_in: dict
    """Key (allocated in iteration 0, freed in iteration 1) -> its rank in allocation order."""
    setup: set
    """Keys allocated before iteration 0."""
    carry_out: list
    """Keys iteration 1 allocates and the stream never frees, in allocation order."""
    carry0: list
    """Keys of `carry_in`, in allocation order (what step 0 hands to step 1)."""


def _split(s: ShapeStream) -> _Split:
    born: dict = {}
    for i, (action, key, _) in enumerate(s.events):
        if action == "alloc":
            born[key] = i
    freed_in_1 = [k for a, k, _ in s.events[s.start1:] if a == "free" and k in born
                  and s.start0 <= born[k] < s.start1]
    carry0 = sorted(set(freed_in_1), key=born.get)
    freed = {k for a, k, _ in s.events if a == "free"}
    carry_out = sorted((k for k, i in born.items() if i >= s.start1 and k not in freed),
                       key=born.get)
    return _Split(s.events[:s.start1], s.events[s.start1:], {k: r for r, k in enumerate(carry0)},
                  {k for k, i in born.items() if i < s.start0}, carry_out, carry0)


@dataclass
class Replayed:
    """The composed replay: per step its reserved bytes (simulated, unshifted)."""

    reserved: np.ndarray
    peak_reserved: int
    replayed_steps: int
    retries: int = 0
    """cudaMalloc retries (the allocator freed its cache at the capacity)."""
    oom: bool = False
    """The replay ran out of memory within the capacity (this is then the unlimited one)."""
    oom_step: int | None = None
    """The step at which the replay within the capacity ran out of memory."""
    oom_held: tuple[int, int] = (0, 0)
    """(allocated, reserved) bytes of the replay within the capacity when it ran out."""


def replay_steps(streams: list[ShapeStream], index: np.ndarray,
                 config: AllocatorConfig | None = None, capacity: int | None = None,
                 empties: np.ndarray | None = None) -> Replayed:
    """Replay the run whose step j has shape `streams[index[j]]` (see the module docstring);
    within `capacity` bytes as `allocator.reserved.capped_replay` does (at the limit the
    allocator frees its cache and retries; one that still runs out is replayed unlimited).
    `empties`: per step, whether its `empty_cache` calls run (streams made with
    `empty_cache_steps=1` carry one at every place the loop calls it); None: as the streams
    say."""
    config = config if config is not None else AllocatorConfig.from_environ()
    if capacity is not None:
        try:
            return _replay(streams, index, config, capacity, empties)
        except SimulatedOOM as err:
            return dataclasses.replace(_replay(streams, index, config, None, empties), oom=True,
                                       oom_step=getattr(err, "step", None),
                                       oom_held=getattr(err, "held", (0, 0)))
    return _replay(streams, index, config, None, empties)


def _replay(streams, index, config, capacity, empties) -> Replayed:
    splits = [_split(s) for s in streams]
    sim = CachingAllocatorSim(config, capacity=capacity)
    live: dict = {}
    reserved = np.zeros(len(index), dtype=np.int64)
    seen: set = set()
    handed: list = []  # what the previous step left for the next one, as run keys
    replayed = 0

    def feed(events, tag, remap, empty=True) -> int:
        top = sim.reserved
        for action, key, size in events:
            if action == "alloc":
                live[(tag, key)] = sim.malloc(size)
            elif action == "free":
                addr = live.pop(remap(key), None)
                if addr is not None:
                    sim.free(addr)
            elif empty:
                sim.empty_cache()
            top = max(top, sim.reserved)
        return top

    first = splits[index[0]]
    empty = (lambda j: True) if empties is None else (lambda j: bool(empties[j]))
    j = 0
    try:
        # the prefix holds setup and iteration 0: its empty_cache calls are iteration 0's
        reserved[0] = feed(first.prefix, 0, lambda k: (0, k), empty(0))
        setup_tag = {k: (0, k) for k in first.setup}
        handed = [(0, k) for k in first.carry0]
        replayed = 1
        for j in range(1, len(index)):
            pair = (int(index[j - 1]), int(index[j]), empty(j))
            if pair in seen:
                reserved[j] = sim.reserved
                continue
            seen.add(pair)
            sp = splits[index[j]]
            prev = handed

            def remap(key, sp=sp, prev=prev, j=j):
                rank = sp.carry_in.get(key)
                if rank is not None:
                    return prev[rank] if rank < len(prev) else None
                if key in sp.setup:
                    return setup_tag.get(key)
                return (j, key)

            reserved[j] = feed(sp.segment, j, remap, empty(j))
            for key in prev:  # a previous shape that handed more than this one takes
                if key in live:
                    sim.free(live.pop(key))
            handed = [(j, k) for k in sp.carry_out]
            replayed += 1
    except SimulatedOOM as err:
        err.step = j  # where the run ran out, with what it held: the run's answer says so
        err.held = (sim.allocated, sim.reserved)
        raise
    return Replayed(reserved, sim.peak_reserved, replayed, sim.num_alloc_retries)


def _shape_spec(spec: TrainingSpec, shape: Shape) -> TrainingSpec:
    return spec.with_(lengths=None, micro_batch=shape.batch, seq_len=shape.tokens,
                      images_per_sample=None if shape.images < 0 else shape.images,
                      padded=shape.padded)


def _series(values: np.ndarray, points: int = SERIES_POINTS) -> dict:
    n = len(values)
    step = max(1, -(-n // points))
    idx = np.arange(0, n, step)
    return {"step": idx.tolist(), "reserved_bytes": np.maximum.reduceat(values, idx).tolist()}


def _shape_streams(spec: Job, steps, method: str, ws) -> tuple[list, np.ndarray | None]:
    """One alloc/free stream per distinct shape, by `method`'s closed forms or trace; and,
    with empty_cache every N > 1 steps, which steps call it: the streams then carry a call at
    every place the loop makes one, kept on the steps `empty_cache_at` names (two iterations
    show N = 1 only)."""
    every = spec.empty_cache_steps > 1
    stream_spec = spec.with_(empty_cache_steps=1) if every else spec
    empties = np.array([empty_cache_at(spec, j) is not None for j in range(len(steps))]) \
        if every else None
    streams = []
    for shape in steps.shapes:
        try:
            streams.append(shape_stream(method, _shape_spec(stream_spec, shape), ws))
        except SpecError as err:
            raise SpecError(err.field, err.value, err.choices, reason=f"{err.reason} (a batch "
                            f"of {shape.batch} x {shape.tokens} tokens from --lengths)") from None
    return streams, empties


def _run_info(data, steps, spec: Job, allocated: np.ndarray, top: int, per_step: np.ndarray,
              run, limit, growth: int, at_cap: int, at_longest: int) -> dict:
    """`extras["lengths"]`: the run's batches, shapes, steps and reserved figures."""
    longest = steps.shapes[top]
    first_top = int(np.argmax(steps.index == top))
    peak_step = int(np.argmax(per_step >= per_step.max()))
    return {
        "source": data.source, "samples": len(data), "samples_seen": steps.samples,
        "epochs": steps.epochs, "batches": steps.batches, "steps": len(steps),
        "sampler": spec.sampler, "pad_to": spec.pad_to, "packing": spec.packing,
        "distinct_shapes": [
            {"batch": s.batch, "tokens": s.tokens, "images": None if s.images < 0 else s.images,
             "steps": int((steps.index == i).sum()), "allocated_bytes": int(allocated[i])}
            for i, s in enumerate(steps.shapes)],
        "padded_tokens": {"p50": int(np.percentile(steps.padded, 50)),
                          "max": int(steps.padded.max())},
        "longest_batch": {"batch": longest.batch, "tokens": longest.tokens,
                          "images": None if longest.images < 0 else longest.images,
                          "first_step": first_top},
        "reserved_per_step": {"p50": int(np.percentile(per_step, 50)),
                              "p99": int(np.percentile(per_step, 99)),
                              "max": int(per_step.max())},
        "peak_step": peak_step,
        "replayed_steps": run.replayed_steps,
        "capacity_bytes": limit, "num_alloc_retries": run.retries, "oom": run.oom,
        "shape_growth_bytes": growth,
        "reserved_at_cap_bytes": at_cap,
        "reserved_at_longest_batch_bytes": at_longest,
        "per_step": _series(per_step),
    }


def simulate(spec: Job, method: str, price: Callable[[TrainingSpec], Prediction],
             gpu: GPU | None = None) -> Prediction:
    """`spec`'s answer over the batches its lengths file makes: the tier's answer (`price`) at
    the step of the largest allocated peak, reserved raised by what the changing shapes add in
    the composed replay; `extras["lengths"]` the run's figures."""
    data = read_lengths(spec.lengths)
    images = -1 if spec.images_per_sample is None else spec.images_per_sample
    steps = plan(data, spec, images)
    stream_method = "trace" if method == "trace" else "analytic"
    streams, empties = _shape_streams(spec, steps, stream_method, cublas_workspace(gpu))
    allocated = np.array([s.allocated for s in streams], dtype=np.int64)
    top = max(range(len(streams)), key=lambda i: (allocated[i], steps.shapes[i].tokens))
    answer = price(_shape_spec(spec, steps.shapes[top]))
    limit = gpu_capacity(gpu, FROM_GPU)  # the GPU's, as the tiers replay within
    # the composed streams are one GPU's: with several ranks their replay within the GPU's
    # capacity is not a rank's, so it bounds nothing there (the rank's own verdict stands)
    run_limit = limit if spec.parallel.world_size == 1 else None
    run = replay_steps(streams, steps.index, capacity=run_limit, empties=empties)
    alone = replay_steps([streams[top]], np.zeros(2, dtype=np.int64), capacity=run_limit,
                         empties=None if empties is None else empties[:2]).peak_reserved
    if run.oom:  # the run's growth as the unlimited replays see it
        alone = replay_steps([streams[top]], np.zeros(2, dtype=np.int64),
                             empties=None if empties is None else empties[:2]).peak_reserved
    growth = max(0, run.peak_reserved - alone)
    shift = answer.peak.reserved_bytes - alone
    per_step = run.reserved + shift
    cap = price(spec.with_(lengths=None)) if steps.shapes[top] != Shape(
        spec.micro_batch, spec.seq_len, images) else answer
    verdict = _run_verdict(answer, run, limit, steps.shapes[int(steps.index[run.oom_step])]
                           if run.oom_step is not None else None, run.oom_step)
    reserved = answer.peak.reserved_bytes + growth
    if verdict.allocator is not None:
        reserved = verdict.reserved(reserved, answer.peak.allocated_bytes)
    growth = reserved - answer.peak.reserved_bytes
    peak = dataclasses.replace(answer.peak, reserved_bytes=reserved,
                               device_bytes=answer.peak.device_bytes + growth)
    breakdown = {**answer.breakdown,
                 "fragmentation": answer.breakdown.get("fragmentation", 0) + growth}
    longest = steps.shapes[top]
    info = _run_info(data, steps, spec, allocated, top, per_step, run, limit, growth,
                     cap.peak.reserved_bytes, answer.peak.reserved_bytes)
    note = (f"lengths: {len(data)} samples from {data.source} -> {len(steps)} steps "
            f"({spec.sampler} sampler, pad to {spec.pad_to}); priced at the largest step "
            f"({longest.batch} x {longest.tokens} tokens), {len(steps.shapes)} distinct "
            f"shapes replayed in order ({run.replayed_steps} steps), + {growth >> 20} MiB "
            "reserved from changing shapes (docs/lengths.md)")
    gap = steps_gap(steps) if stream_method == "analytic" else None
    if gap is not None:  # the chooser takes the trace tier for such a run (intake.resolve)
        note += (f"; the closed form's growth may not be the trace tier's here: {gap}; "
                 "--method trace prices it")
    info["closed_form_gap"] = gap
    extras = {**answer.extras, "lengths": info}
    if verdict.allocator is not None:
        extras["allocator"] = verdict.allocator
    return dataclasses.replace(answer, peak=peak, breakdown=breakdown,
                               notes=(*verdict.notes, note), extras=extras)


CAPACITY_VERDICTS = ("does not fit", "fits only after")
"""How the capacity replay's verdict notes begin (`allocator.reserved.capacity_notes`)."""


@dataclass(frozen=True)
class _Verdict:
    """What the run's replay within the GPU's capacity says, in place of the priced shape's own
    replay: the JSON `allocator` object and the notes, so that `fit`, `fits`, `allocator.oom`
    and the notes all speak of the run (docs/design.md, "The verdict")."""

    allocator: dict | None
    notes: tuple[str, ...]

    def reserved(self, estimate: int, allocated: int) -> int:
        """The run's reserved bytes within the capacity: an allocator that completed the run
        never held more than the capacity (it released its cache instead); one that ran out
        held more than it (the unlimited replay's peak, as `allocator.reserved.bounded`)."""
        capacity = self.allocator["capacity_bytes"]
        if self.allocator["oom"]:
            return max(estimate, capacity + 1)
        return max(allocated, min(estimate, capacity))


def _run_verdict(answer: Prediction, run: Replayed, capacity: int | None, oom_shape,
                 oom_step: int | None) -> _Verdict:
    """The run's allocator verdict: the priced shape's capacity notes (`CAPACITY_VERDICTS`) are
    replaced by the run's, as the run's replay decides (it replays that shape too)."""
    own = answer.extras.get("allocator")
    if capacity is None or own is None:
        return _Verdict(None, answer.notes)
    kept = tuple(n for n in answer.notes if not n.startswith(CAPACITY_VERDICTS))
    oom = run.oom or bool(own.get("oom"))
    retries = max(run.retries, own.get("num_alloc_retries", 0))
    gib = 1 << 30
    if run.oom:
        where = (f"at step {oom_step} (a {oom_shape.batch} x {oom_shape.tokens} batch)"
                 if oom_shape is not None else "")
        alone = ("; that shape replayed alone does not run out: the cached segments the "
                 "earlier, differently shaped batches left cannot hold its tensors (fragmentation)"
                 if not own.get("oom") else "")
        line = (f"does not fit: over the run's batches the simulated allocator runs out of "
                f"memory {where} even after releasing its cached blocks, holding "
                f"{run.oom_held[0] / gib:.2f} GiB of tensors in {run.oom_held[1] / gib:.2f} GiB "
                f"reserved of the {capacity / gib:.2f} GiB capacity{alone}; reserved is the "
                "unlimited replay's")
    elif own.get("oom"):
        line = next((n for n in answer.notes if n.startswith("does not fit")), "does not fit")
    elif retries:
        line = (f"fits only after the allocator released its cache: {retries} cudaMalloc "
                "retr" + ("y" if retries == 1 else "ies") + " (num_alloc_retries) over the "
                "run's replayed steps, each freeing every cached segment (cudaFree "
                "synchronizes the device): it fits, with allocator retries that cost time")
    else:
        line = None
    # own: the rank's capacity; its uncapped figure is the shape's alone, not the run's
    allocator = {**{k: v for k, v in own.items() if k != "uncapped_reserved_bytes"},
                 "num_alloc_retries": retries, "oom": oom}
    return _Verdict(allocator, kept + ((line,) if line else ()))


def summary(info: dict) -> str:
    """The console's one line of a `lengths` object."""
    r = info["reserved_per_step"]
    gib = 1 << 30
    lb = info["longest_batch"]
    return (f"lengths: {info['samples']} samples, {info['steps']} steps, longest batch "
            f"{lb['batch']}x{lb['tokens']} (step {lb['first_step']}); reserved per step "
            f"p50 {r['p50'] / gib:.2f} / p99 {r['p99'] / gib:.2f} / max {r['max'] / gib:.2f} "
            f"GiB, first at step {info['peak_step']}; at the cap "
            f"{info['reserved_at_cap_bytes'] / gib:.2f} GiB")
