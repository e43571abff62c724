"""ORACLE for --lengths: a real (non-fake) CPU run of several steps over changing batch shapes.

The user's loop (transformers Trainer's step: `loss = model(**batch).loss; loss.backward();
optimizer.step(); optimizer.zero_grad(set_to_none=True)`) runs on real CPU tensors of
tiny-llama, one freshly collated batch per step, shapes in the order a `--lengths` run makes
them; live bytes are counted by storage address (`DataPtrCounter`, independent of the tracker).
Each step's peak must equal, to the byte, the trace tier's peak at that shape: iteration 0's
for the first step (the optimizer state appears there), iteration 1's for the others.
"""

from __future__ import annotations

import json
import weakref

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hybridmem.allocator import AllocatorConfig, CachingAllocatorSim

from hybridmem.job.spec import TrainingSpec
from hybridmem.models import load_config
from hybridmem.trace import corrections, runner
from hybridmem.trace.inputs import make_batch
from hybridmem.trace.model import PARAM_DTYPE
from hybridmem.trace.optimizers import host_state_keys
from test_trace import DataPtrCounter

SHAPES = (64, 20, 40, 64, 20)
"""Padded lengths of the steps (micro-batch 2): long, short, middle, long again, short again."""


def _real_step_peaks(spec: TrainingSpec) -> list[int]:
    torch.manual_seed(0)
    config = load_config(spec.model)
    peaks = []
    with corrections.patched_model_checks():
        job = runner.prepare(spec.with_(seq_len=SHAPES[0]), config)
        model, opt = job.model, job.optimizer
        job.batch = None  # each step collates its own batch
        counter = DataPtrCounter([*model.parameters(), *model.buffers()])
        with counter:
            for length in SHAPES:
                batch, _ = make_batch(spec.with_(seq_len=length), config, None,
                                      PARAM_DTYPE[spec.precision])
                counter.peak = counter.current
                for t in batch.values():
                    if isinstance(t, torch.Tensor):
                        counter._add(t.untyped_storage())
                loss = model(**batch, use_cache=False).loss
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=True)
                peaks.append(counter.peak)
                del batch
    return peaks


def _trace_iteration_peaks(spec: TrainingSpec) -> tuple[int, int]:
    """The trace tier's live-bytes peak (host scalars included, as on real CPU tensors) over
    iteration 0 and over iteration 1."""
    tracker, _ = runner.trace(spec, load_config(spec.model), backend="meta")
    curve = tracker.live_curve(device_only=False)
    start1 = min(at for at, phase, it in tracker.marks if it == 1 and phase == "forward")
    return int(curve[:start1].max()), int(curve[start1:].max())


def test_real_step_peaks_equal_the_trace_tier_per_shape():
    spec = TrainingSpec(model="tiny-llama", micro_batch=2, seq_len=64, precision="bf16")
    real = _real_step_peaks(spec)
    traced = {n: _trace_iteration_peaks(spec.with_(seq_len=n)) for n in set(SHAPES)}
    expected = [traced[SHAPES[0]][0]] + [traced[n][1] for n in SHAPES[1:]]
    assert real == expected
    assert len(set(np.diff(real))) > 1  # the shapes do change the peak


# --- reserved: the real run's own alloc/free stream through the allocator simulator ---------

WIDE = {"vocab_size": 16000, "hidden_size": 256, "intermediate_size": 688, "head_dim": 64}
"""tiny-llama widened so its stream spans several segments of the default `AllocatorConfig`
(bf16 embedding and lm_head 7.8 MiB each; at 256 tokens bf16 logits of 2 x 256 x 16000 15.6
MiB and their fp32 loss copy 31.3 MiB: 20 MiB large-pool segments and segments of their own,
CUDACachingAllocator's kLargeBuffer / kMinLargeAlloc)."""
GROWING = (32, 128, 256, 32, 256, 128)
"""Short first, so the reserved bytes grow with the later, longer steps."""


class StreamRecorder(TorchDispatchMode):
    """A real run's alloc/free stream by storage address: ("alloc", id, nbytes) when an op's
    output has a storage not seen live, ("free", id, 0) when that storage dies."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, int, int]] = []
        self.live: dict[int, int] = {}  # data_ptr -> id
        self.marks: list[int] = []  # event index where each step's batch is collated
        self._next = 0

    def add(self, st) -> None:
        ptr = st.data_ptr()
        if st.nbytes() == 0 or ptr in self.live:
            return
        self.live[ptr] = key = self._next
        self._next += 1
        self.events.append(("alloc", key, st.nbytes()))
        weakref.finalize(st, self._drop, ptr)

    def _drop(self, ptr: int) -> None:
        self.events.append(("free", self.live.pop(ptr), 0))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.add(t.untyped_storage())
        return out


def _real_stream(spec: TrainingSpec, shapes) -> tuple[list, list[int]]:
    """The oracle loop of `_real_step_peaks` over `shapes`, its model built under the recorder;
    the optimizer's host `step` scalars (CPU tensors on CUDA too, `host_state_keys`) dropped."""
    torch.manual_seed(0)
    config = load_config(spec.model)
    rec = StreamRecorder()
    with corrections.patched_model_checks(), rec:
        job = runner.prepare(spec.with_(seq_len=shapes[0]), config)
        model, opt = job.model, job.optimizer
        job.batch = None  # each step collates its own batch
        for length in shapes:
            rec.marks.append(len(rec.events))
            batch, _ = make_batch(spec.with_(seq_len=length), config, None,
                                  PARAM_DTYPE[spec.precision])
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
            del batch
        host = {rec.live[t.untyped_storage().data_ptr()] for state in opt.state.values()
                for k, t in state.items() if k in host_state_keys(spec.optimizer)}
    keep = [i for i, e in enumerate(rec.events) if e[1] not in host]
    marks = [sum(1 for i in keep if i < m) for m in rec.marks]
    return [rec.events[i] for i in keep], marks


def _per_step_reserved(events, marks) -> list[int]:
    sim = CachingAllocatorSim(AllocatorConfig())
    addr, out = {}, []
    bounds = [*marks[1:], len(events)]
    top, step = 0, 0
    for i, (action, key, size) in enumerate(events):
        if action == "alloc":
            addr[key] = sim.malloc(size)
        elif key in addr:
            sim.free(addr.pop(key))
        top = max(top, sim.reserved)
        if i + 1 == bounds[step]:
            out.append(top)
            step += 1
            top = sim.reserved
    return out


def test_real_run_stream_replayed_gives_the_composed_per_step_reserved(tmp_path):
    from hybridmem.batches.run import replay_steps, shape_stream
    from hybridmem.models.loader import load_config_dict

    cfg = load_config_dict("tiny-llama")[1]
    cfg.pop("_source")
    cfg.update(WIDE)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = TrainingSpec(model=str(tmp_path / "config.json"), micro_batch=2, seq_len=64,
                        precision="bf16")
    events, marks = _real_stream(spec, GROWING)
    real = _per_step_reserved(events, marks)
    order = sorted(set(GROWING))
    streams = [shape_stream("trace", spec.with_(seq_len=n), workspace=0) for n in order]
    composed = replay_steps(streams, np.array([order.index(n) for n in GROWING]),
                            config=AllocatorConfig())
    assert real == composed.reserved.tolist()
    assert len(set(real)) > 1 and max(real) > 3 * (20 << 20)  # several segments, and it moves
