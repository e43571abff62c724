"""ORACLE for --lengths: a real (non-fake) CPU run of several steps over changing batch shapes.

The user's loop (transformers Trainer's step: `loss = model(**batch).loss; loss.backward();
optimizer.step(); optimizer.zero_grad(set_to_none=True)`) runs on real CPU tensors of
tiny-llama, one freshly collated batch per step, shapes in the order a `--lengths` run makes
them; live bytes are counted by storage address (`DataPtrCounter`, independent of the tracker).
Each step's peak must equal, to the byte, the trace tier's peak at that shape: iteration 0's
for the first step (the optimizer state appears there), iteration 1's for the others.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridmem.job.spec import TrainingSpec
from hybridmem.models import load_config
from hybridmem.trace import corrections, runner
from hybridmem.trace.inputs import make_batch
from hybridmem.trace.model import PARAM_DTYPE
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
