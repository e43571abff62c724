"""One rank's approximate alloc/free stream, for its fragmentation (reserved - allocated).

Why: fragmentation depends on the sizes and order of what a GPU allocates. A ZeRO-3 rank of a
148 GiB single-GPU job holds ~36 GiB of tensors; giving it the single-GPU replay's 8 GiB of
fragmentation (what `estimate_per_rank` did) prices cached segments that the rank never has.
So the analytic tier's stream of the single-GPU job (`analytic.events.build`, its own
activations unchanged: data parallelism keeps each rank's micro-batch) is rewritten with the
rank's model states (`parallel.sharding.rank_states`) and replayed through the same simulator.

Each event of the single-GPU stream is classified by when it is allocated and freed (the
phase marks `events.build` records), then scaled so that the category's peak of live bytes in
the stream becomes the rank's closed-form figure for it (`parallel.sharding.RankStates`):
- setup parameters / buffers / adapters: `RankStates.param`;
- setup fp32 master copies and the optimizer state made in iteration 0's step (never freed):
  `RankStates.optimizer` (ZeRO keeps masters and state together);
- tensors made in backward and freed in the same iteration's optimizer phase (the grads):
  the growing grads, `grad - grad_fixed` (0 under ZeRO-2/3: grads land in the partition
  buffer instead);
- tensors made and freed inside the optimizer phase (clip and step temporaries, bf16-master
  fp32 grads): `RankStates.step_temporary` (ZeRO's fp32 partition replaces the fp32 grads);
- everything else (batch, activations, forward/backward transients, workspaces) unchanged.
Scaling by the live peak rather than by the one-GPU closed form keeps the rank's stream at
the per-rank closed form where the two count a category differently (the stream's bf16-master
fp32 grads are step temporaries, the closed form's one-GPU step_temporary leaves them out).
Added: `grad_fixed` (DDP buckets, ZeRO partition / ipg buffers) as one tensor after setup;
`gathered` (ZeRO-3 live set, FSDP unsharded units) as one tensor from each iteration's first
forward to its optimizer step; `comm` (FSDP reduce-scatter buffers) from each backward to the
next phase.
Approximated (documented, not hidden): each scaled tensor keeps its place and count (FSDP2's
per-parameter shards are like that; DeepSpeed's flat partitions are fewer, larger tensors);
gathers and reductions are one tensor each rather than one per unit, so their churn (which
mostly reuses the same cached segments) is not replayed; NCCL's own buffers are outside the
allocator (they lower the capacity instead, `estimate_per_rank`).
"""

from __future__ import annotations

from functools import lru_cache

from hybridmem.allocator.alloc import t
from hybridmem.allocator.replay import peak_requested
from hybridmem.parallel.sharding import RankStates, rank_states
from hybridmem.job.parallel import ParallelSpec
from hybridmem.parallel.states import model_tensors
from hybridmem.job.spec import POLICIES, TrainingSpec

KEEP, PARAM, OPT, GRAD, TEMP = range(5)


def _ratio(rank: int, one: int) -> tuple[int, int]:
    return (rank, one) if one else (1, 1)


def _scaled(size: int, ratio: tuple[int, int]) -> int:
    """`size * ratio`, rounded up to the allocator's 512-byte unit (`allocator.alloc.t`)."""
    num, den = ratio
    return t(-(-size * num // den), 1) if size * num else 0


def setup_counts(priced, policy) -> tuple[int, int]:
    """(parameter-like, fp32 master) allocations `events.build` makes at setup, in its order."""
    params = sum(1 for p in priced for q in (*p.layer.params, *p.layer.buffers, *p.layer.lora,
                                             *p.layer.copies)
                 if t(q.numel, q.itemsize or policy.param_bytes) > 0)
    masters = sum(1 for p in priced if p.layer.trainable for q in p.layer.params
                  if t(q.numel, policy.master_bytes) > 0) if policy.master_bytes else 0
    return params, masters


def classify(events: list[tuple], marks: list[tuple[int, str, int]], n_param: int,
             n_master: int) -> dict:
    """key -> category (KEEP, PARAM, OPT, GRAD, TEMP) of every allocation (module docstring)."""
    starts = [m[0] for m in marks]
    phase_at = []  # per event: (phase, iteration) of the last mark at or before it
    j, current = 0, ("setup", -1)
    for i in range(len(events)):
        while j < len(marks) and starts[j] <= i:
            current = (marks[j][1], marks[j][2])
            j += 1
        phase_at.append(current)
    born: dict = {}
    died: dict = {}
    setup = 0
    out: dict = {}
    for i, (action, key, _) in enumerate(events[:len(phase_at)]):
        if action == "alloc":
            born[key] = i
            if phase_at[i][0] == "setup":
                out[key] = PARAM if setup < n_param else OPT if setup < n_param + n_master else KEEP
                setup += 1
        elif action == "free":
            died[key] = i
    for key, i in born.items():
        if key in out:
            continue
        phase, it = phase_at[i]
        end = died.get(key)
        end_phase = phase_at[end] if end is not None else None
        if phase == "backward" and end_phase == ("optimizer", it):
            out[key] = GRAD
        elif phase == "optimizer" and end is None and it == 0:
            out[key] = OPT
        elif phase == "optimizer" and end_phase == ("optimizer", it):
            out[key] = TEMP
        else:
            out[key] = KEEP
    return out


def live_peaks(events, kinds: dict) -> dict[int, int]:
    """Category -> peak of its live bytes over the stream."""
    live: dict = {}
    now = dict.fromkeys(range(5), 0)
    top = dict(now)
    for action, key, size, *_ in events:
        kind = kinds.get(key, KEEP)
        if action == "alloc":
            live[key] = size
            now[kind] += size
            top[kind] = max(top[kind], now[kind])
        elif action == "free":
            now[kind] -= live.pop(key, 0)
    return top


def rewrite(events, marks, kinds: dict, rank: RankStates) -> list[tuple]:
    """The single-GPU stream with each allocation scaled to the rank's share of its category
    and the rank's own buffers added (module docstring)."""
    top = live_peaks(events, kinds)
    ratios = {KEEP: (1, 1), PARAM: _ratio(rank.param, top[PARAM]),
              OPT: _ratio(rank.optimizer, top[OPT]),
              GRAD: _ratio(rank.grad - rank.grad_fixed, top[GRAD]),
              TEMP: _ratio(rank.step_temporary, top[TEMP])}
    at: dict[int, list[tuple]] = {}  # event index -> events to insert before it

    def add(index: int, *new: tuple) -> None:
        at.setdefault(index, []).extend(new)

    if marks:
        add(marks[0][0], ("alloc", ("rank", "grad_fixed"), rank.grad_fixed))
    seen_forward: set[int] = set()
    comm_open = None
    for n, (index, phase, it) in enumerate(marks):
        if comm_open is not None:
            add(index, ("free", comm_open, 0))
            comm_open = None
        if phase == "forward" and it not in seen_forward:
            seen_forward.add(it)
            add(index, ("alloc", ("rank", "gathered", it), rank.gathered))
        elif phase == "backward" and rank.comm:
            comm_open = ("rank", "comm", n)
            add(index, ("alloc", comm_open, rank.comm))
        elif phase == "optimizer":
            add(index, ("free", ("rank", "gathered", it), 0))
    out: list[tuple] = []
    for i, event in enumerate(events):
        out += at.get(i, ())
        action, key, size = event[:3]
        if action == "alloc":
            out.append(("alloc", key, _scaled(size, ratios[kinds.get(key, KEEP)])))
        else:
            out.append(event)
    if comm_open is not None:
        out.append(("free", comm_open, 0))
    return out


def rank_events(spec: TrainingSpec, workspace: int) -> tuple[int, list[tuple]]:
    """(peak live bytes, event stream) of one rank of `spec` (module docstring); raises
    `SpecError` where the analytic tier has no stream (e.g. `train='peft'`)."""
    from hybridmem.analytic.estimate import setup, stream
    from hybridmem.parallel.phases import forward_precision

    single = spec.with_(parallel=ParallelSpec(), precision=forward_precision(spec))
    _, priced, statics = setup(single, workspace)
    events, marks = stream(single, workspace)  # the single-GPU replay's stream, built once
    n_param, n_master = setup_counts(priced, POLICIES[single.precision])
    mt = model_tensors(spec)
    stream = rewrite(events, marks, classify(events, marks, n_param, n_master),
                     rank_states(spec, mt))
    return peak_requested(stream), stream


@lru_cache(maxsize=None)
def measure_with(workspace: int):
    """`rank_events` for one workspace size, the same function object each time, so that
    `allocator.reserved.bounded`'s cache (keyed by it) serves every micro-batch probe."""
    return lambda spec: rank_events(spec, workspace)
