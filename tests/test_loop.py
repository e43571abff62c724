"""The training loop of the spec: `loop`, `max_grad_norm`, `grad_accum`.

The trace tier is checked against a real CPU run of each loop written out here as a user
writes it (not through `runner.train`), to the byte; the analytic tier against the trace tier
(tolerances of test_analytic_vs_trace.py); the differences between loops against hand
derivations.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridmem.analytic import estimate as analytic
from hybridmem.allocator.overheads import CUBLAS_HANDLES_TRAINING, CUBLAS_WORKSPACE_BYTES
from hybridmem.analytic.states import Stepped, clip_temporary
from hybridmem.errors import SpecError
from hybridmem.models import load_config
from hybridmem.job.spec import TrainingSpec
from hybridmem.trace import corrections, estimate as trace_estimate, runner
from test_analytic_vs_trace import TOL, _check
from test_trace import DataPtrCounter, rounded




def tiny(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": "tiny-llama", "micro_batch": 2, "seq_len": 64,
                           "precision": "bf16", **kw})


def user_loop(spec: TrainingSpec, after_step: list | None = None) -> int:
    """Peak bytes of two steps of the user's loop on real CPU tensors (`DataPtrCounter`).

    trainer: `loss = model(**batch).loss` (transformers Trainer.training_step);
    custom: `outputs = model(**batch); outputs.loss.backward()` (peft MetaMathQA/run.py);
    loss / grad_accum per micro-step; `clip_grad_norm_(foreach=True)` with CUDA's
    `_foreach_norm` scratch (`corrections.cuda_foreach_norm`, tested on its own below)."""
    torch.manual_seed(0)
    with corrections.patched_model_checks():
        job = runner.prepare(spec, load_config(spec.model))
        model, opt, batch = job.model, job.optimizer, job.batch
        params = [p for _, p in job.trainable]
        start = [*model.parameters(), *model.buffers(),
                 *(t for t in batch.values() if isinstance(t, torch.Tensor))]
        counter = DataPtrCounter(start)
        with counter:
            outputs = None
            for _ in range(2):
                for _ in range(spec.grad_accum):
                    if spec.loop == "custom":
                        outputs = model(**batch, use_cache=False)
                        loss = outputs.loss
                    else:
                        loss = model(**batch, use_cache=False).loss
                    if spec.grad_accum > 1:
                        loss = loss / spec.grad_accum
                    loss.backward()
                    del loss
                if spec.max_grad_norm:
                    with corrections.cuda_foreach_norm():
                        torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm, foreach=True)
                opt.step()
                if after_step is not None:  # what memory_allocated() reads right after the step
                    after_step.append(counter.current)
                opt.zero_grad(set_to_none=True)
            del outputs
    return counter.peak


LOOPS = [dict(loop="custom"), dict(max_grad_norm=1.0), dict(grad_accum=2),
         dict(loop="custom", max_grad_norm=0.5, grad_accum=3)]
CASES = [dict(model=m, precision=p, **kw) for m in ("tiny-llama", "tiny-llava")
         for p in ("bf16", "fp32") for kw in LOOPS]


def _id(kw: dict) -> str:
    return "-".join(str(v) for v in kw.values())


@pytest.mark.parametrize("kw", CASES, ids=_id)
def test_trace_equals_the_users_loop_on_real_tensors(kw):
    spec = tiny(**kw)
    for backend in ("fake", "meta"):
        tracker, _ = runner.trace(spec, load_config(spec.model), backend=backend)
        # host scalars (AdamW `step`) are real CPU tensors in the user's loop too
        assert int(tracker.live_curve(device_only=False).max()) == user_loop(spec), backend


@pytest.mark.parametrize("kw", [dict(), dict(loop="custom", max_grad_norm=1.0),
                                dict(model="tiny-llava", loop="custom", train="lora")], ids=_id)
def test_after_step_allocated_equals_the_users_loop_and_the_analytic_tier(kw):
    spec = tiny(**kw)
    real: list[int] = []
    user_loop(spec, real)
    tracker, job = runner.trace(spec, load_config(spec.model))
    assert int(tracker.live_curve(device_only=False)[job.after_step[-1]]) == real[-1]
    # the Prediction's figure counts device bytes only (AdamW's `step` scalars live on the CPU)
    # and the cuBLAS workspaces, which CUDA takes from the caching allocator (one per handle)
    t = trace_estimate(spec).extras["after_step_allocated_bytes"]
    assert t == int(tracker.live_curve()[job.after_step[-1]]) + CUBLAS_HANDLES_TRAINING * \
        CUBLAS_WORKSPACE_BYTES
    assert analytic(spec).extras["after_step_allocated_bytes"] == pytest.approx(t, rel=TOL)


def _births(spec: TrainingSpec):
    """Live bytes after each allocation, and its (phase, iteration)."""
    tracker, job = runner.trace(spec, load_config(spec.model))
    curve = tracker.live_curve(device_only=False)
    idx = np.nonzero(np.asarray(tracker.events) >= 0)[0]
    return curve[idx], [tracker.phase_at(int(i)) for i in idx], tracker, job


def test_custom_loop_holds_one_logits_tensor_through_backward():
    trainer, phases, _, _ = _births(tiny())
    custom, _, _, _ = _births(tiny(loop="custom"))
    logits = rounded(2 * 64 * 128 * 2)  # micro_batch x seq_len x vocab x bf16, as lm_head returns
    loss = rounded(4)                    # the fp32 loss the output object keeps after backward
    diff = {}
    for d, ph in zip(custom - trainer, phases):  # the same allocations in the same order
        diff.setdefault(ph, set()).add(int(d))
    assert diff[("forward", 0)] == {0}
    assert diff[("backward", 0)] == diff[("backward", 1)] == {logits}
    # after backward and through the next forward (until `outputs = model(...)` rebinds)
    assert diff[("optimizer", 0)] == diff[("forward", 1)] == {logits + loss}
    a, b = analytic(tiny()), analytic(tiny(loop="custom"))
    assert a.peak.phase == b.peak.phase == "backward"
    assert b.peak.allocated_bytes - a.peak.allocated_bytes == logits
    t0, t1 = trace_estimate(tiny()), trace_estimate(tiny(loop="custom"))
    assert t0.peak.phase == "backward"
    assert t1.peak.allocated_bytes - t0.peak.allocated_bytes == logits


def test_clipping_adds_the_foreach_norm_temporaries():
    # SGD without momentum steps in place: the optimizer phase holds only grads + clipping
    base, clipped = tiny(optimizer="sgd"), tiny(optimizer="sgd", max_grad_norm=1.0)
    peaks = []
    for spec in (base, clipped):
        tracker, _ = runner.trace(spec, load_config(spec.model))
        start = next(at for at, p, i in tracker.marks if (p, i) == ("optimizer", 1))
        peaks.append(int(tracker.live_curve(device_only=False)[start - 1:].max()))
    # tiny-llama: 21 bf16 grads (embedding, 2 x 9 per layer, final norm, lm_head), each
    # < 65536 elements (one chunk). Inside _foreach_norm: 21 0-dim norms, CUDA's fp32
    # scratch of 21 x 1 partial norms and of 320 slots, the unused 0-dim global norm
    n = 21
    inside = n * rounded(2) + rounded(n * 4) + rounded(320 * 4) + rounded(2)
    after = n * rounded(2) + rounded(n * 2) + rounded(2)  # norms, stack(norms), vector_norm
    assert peaks[1] - peaks[0] == max(inside, after) == 13312
    assert clip_temporary([Stepped(64, (64,), 2)] * n) == max(inside, after)


def test_foreach_norm_scratch_is_the_cuda_kernels():
    with torch.device("meta"), corrections.cuda_foreach_norm():
        from hybridmem.trace.tracker import StorageTracker

        grads = [torch.empty(3 * 65536 + 1), torch.empty(5)]
        with StorageTracker() as tr:
            torch._foreach_norm(grads, 2)
    sizes = [s.nbytes for s in tr.storages]
    # output_per_tensor: 2 tensors x 4 chunks (the largest tensor's) fp32; global_output
    # 320 fp32; the two 0-dim norms; the unused 0-dim global norm
    assert sorted(sizes) == sorted([2 * 4 * 4, 320 * 4, 4, 4, 4])


def test_second_micro_step_backward_runs_with_the_grads_live():
    spec = tiny(optimizer="sgd", grad_accum=2)
    curve, phases, tracker, job = _births(spec)
    total = sum(rounded(p.numel() * 2) for _, p in job.trainable)  # every bf16 grad
    marks = [(p, i) for _, p, i in tracker.marks]
    assert marks.count(("backward", 1)) == 2 and marks.count(("forward", 1)) == 2
    second = [at for at, p, i in tracker.marks if (p, i) == ("backward", 1)][1]
    end = next(at for at, p, i in tracker.marks if (p, i) == ("optimizer", 1))
    for at in range(second, end, 7):
        grads = sum(rounded(s.nbytes) for s in tracker.live_at(at) if s.category == "grad")
        assert grads == total
    one = trace_estimate(tiny(optimizer="sgd")).peak.allocated_bytes
    assert trace_estimate(spec).peak.allocated_bytes > one


@pytest.mark.parametrize("kw", [
    dict(model="tiny-llama", loop="custom", precision="bf16-mixed"),
    dict(model="tiny-llava", loop="custom", train="lora"),
    dict(model="tiny-llama", grad_accum=2, grad_ckpt=True),
    dict(model="tiny-llava", grad_accum=3, precision="fp32", optimizer="adamw-fused"),
    dict(model="tiny-llava", max_grad_norm=1.0, precision="bf16-master"),
    dict(model="tiny-llama", loop="custom", max_grad_norm=1.0, grad_accum=2, train="lora"),
], ids=_id)
def test_analytic_agrees_with_trace_on_the_loop(kw):
    _check({"precision": "bf16", **kw})  # tiny()'s shapes; test_analytic_vs_trace's checks


def test_default_loop_is_left_out_of_the_spec_dict():
    assert "loop" not in tiny().to_dict() and tiny(loop="custom").to_dict()["loop"] == "custom"


@pytest.mark.parametrize("field,value", [("loop", "keras"), ("max_grad_norm", -1.0),
                                         ("grad_accum", 0)])
def test_bad_loop_values_name_the_field(field, value):
    with pytest.raises(SpecError, match=field):
        tiny(**{field: value})


def test_sweep_axes_take_the_loop(tmp_path):
    from hybridmem.harness.collection import spec_columns
    from hybridmem.harness.sweep import load_sweep

    path = tmp_path / "s.toml"
    path.write_text('[sweep]\nname = "l"\n[[block]]\nmodel = ["tiny-llama"]\nseq_len = [64]\n'
                    'loop = ["trainer", "custom"]\nmax_grad_norm = [0.0, 1.0]\n'
                    'grad_accum = [1, 2]\n')
    items = load_sweep(path).items
    assert len(items) == 8
    cols = {(c["loop"], c["max_grad_norm"], c["grad_accum"]) for c in map(spec_columns, items)}
    assert cols == {(lp, g, n) for lp in ("trainer", "custom") for g in (0.0, 1.0)
                    for n in (1, 2)}
    path.write_text('[sweep]\n[[block]]\nmodel = ["tiny-llama"]\nloop = ["keras"]\n')
    with pytest.raises(SpecError, match=r"block\[0\]\.loop"):
        load_sweep(path)
