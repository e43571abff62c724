"""Optimizer-in-backward (`--optimizer-in-backward`, hybridmem/techniques/optim_in_backward.py).

torchtune's `register_optim_in_bwd_hooks`: one optimizer per parameter, stepped and zeroed in
its post-accumulate-grad hook, so the gradients are never all alive. Oracles: a real CPU run of
the same hooks (the trace tier must equal its live bytes); the hand derivation of what the step
no longer holds (all grads and the foreach temporaries); the trace tier for the analytic one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hybridmem import TrainingSpec
from hybridmem.analytic import estimate as analytic
from hybridmem.errors import SpecError
from hybridmem.models import load_config
from hybridmem.job.parallel import ParallelSpec

trace = pytest.importorskip("hybridmem.trace")
from hybridmem.trace import runner  # noqa: E402

from test_trace import real_cpu_peak, rounded  # noqa: E402

TOL = 0.03  # analytic vs trace, allocated peak (the brief's bound for this technique)


def spec(model="tiny-llama", oib=True, **kw) -> TrainingSpec:
    return TrainingSpec(**{"model": model, "micro_batch": 1, "seq_len": 40, "precision": "fp32",
                           "optimizer_in_backward": oib, **kw})


def test_default_keeps_the_spec_hash():
    assert "optimizer_in_backward" not in spec(oib=False).to_dict()
    d = spec().to_dict()
    assert d["optimizer_in_backward"] is True
    assert TrainingSpec.from_dict(d) == spec()


@pytest.mark.parametrize("kw, field", [
    (dict(grad_accum=2), "grad_accum"),
    (dict(max_grad_norm=1.0), "max_grad_norm"),
    (dict(precision="fp16-mixed"), "precision"),
    (dict(precision="bf16-master"), "precision"),
    (dict(train="lora", optimizer="lora-fa"), "optimizer"),
    (dict(parallel=ParallelSpec(world_size=2, strategy="zero2")), "parallel.strategy"),
    (dict(parallel=ParallelSpec(world_size=2, strategy="fsdp")), "parallel.strategy"),
])
def test_clashes_are_one_line_spec_errors(kw, field):
    with pytest.raises(SpecError) as err:
        spec(**kw)
    assert err.value.field == field
    assert "\n" not in str(err.value) and "optimizer_in_backward" in str(err.value)


def test_cli_clash_exits_2_naming_it():
    proc = subprocess.run([sys.executable, "-m", "hybridmem.cli", "predict", "--model",
                           "tiny-llama", "--seq-len", "32", "--method", "analytic",
                           "--optimizer-in-backward", "--grad-accum", "4"],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: grad_accum=4: optimizer_in_backward")
    assert proc.stderr.count("\n") == 1


@pytest.mark.parametrize("model, kw", [
    ("tiny-llama", dict()),
    ("tiny-llava", dict()),
    ("tiny-llava", dict(precision="bf16-mixed", grad_ckpt=True, micro_batch=2)),
])
def test_trace_equals_real_cpu_run(model, kw):
    s = spec(model, **kw)
    tracker, _ = runner.trace(s, load_config(model))
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(s)


def test_real_run_steps_every_parameter_once_per_iteration():
    """The hooks are the optimizer step: after two real iterations every trainable parameter
    has its own AdamW whose `step` count is 2 (torch/optim/adamw.py keeps it per parameter),
    and no grad is left (`zero_grad()` in the hook)."""
    from hybridmem.trace import corrections
    from hybridmem.trace.tracker import StorageTracker

    s = spec()
    with corrections.patched_model_checks():
        job = runner.prepare(s, load_config(s.model))
        with StorageTracker() as tracker:
            runner.train(job, s, tracker, 2)
    assert len(job.optimizer.optimizers) == len(job.trainable) > 0
    for _, p in job.trainable:
        assert float(job.optimizer.optimizers[p].state[p]["step"]) == 2.0
        assert p.grad is None


def _grad_bytes(s: TrainingSpec) -> int:
    with torch.device("meta"):
        from hybridmem.trace import corrections

        with corrections.patched_model_checks():
            job = runner.prepare(s, load_config(s.model))
    # with vision_feature_layer=-2 the last CLIP layer and post_layernorm get no grads
    # (docs/design.md, "Checked on CPU"): they hold none to free
    cfg = load_config(s.model)
    unused = ()
    if hasattr(cfg, "vision_config"):
        unused = (f"encoder.layers.{cfg.vision_config.num_hidden_layers - 1}.", "post_layernorm")
    return sum(rounded(p.numel() * p.element_size()) for n, p in job.trainable
               if not any(u in n for u in unused))


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-llava"])
def test_the_step_holds_no_grads(model):
    """Hand derivation: right after the step the plain loop holds params + grads + state
    (+ batch); under optimizer-in-backward the grads (sum of trainable numel x 4 B, 512-rounded,
    from the meta-built model) are already freed, nothing else changes."""
    grads = _grad_bytes(spec(model))
    for tier in (analytic, trace.estimate):
        plain, oib = tier(spec(model, oib=False)), tier(spec(model))
        assert plain.extras["after_step_allocated_bytes"] - oib.extras[
            "after_step_allocated_bytes"] == grads, tier


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-llava"])
def test_peak_leaves_the_optimizer_step(model):
    """fp32 AdamW at seq 40: the plain loop peaks in iteration 0's step (all grads + state +
    the foreach sqrt temporary, one state's worth: torch/optim/adamw.py `_multi_tensor_adamw`).
    In backward the peak holds at most the largest grad, and is lower by at least
    all grads + the sqrt temporary - (activations + the largest grad + its temporary)."""
    for tier in (analytic, trace.estimate):
        plain, oib = tier(spec(model, oib=False)), tier(spec(model))
        assert plain.peak.phase == "optimizer"
        assert oib.peak.phase in ("forward", "backward")
        assert oib.breakdown["grad"] <= max(rounded(128 * 64 * 4), 0) or model != "tiny-llama"
        saved = plain.breakdown["grad"] + plain.breakdown["temporary"]
        bound = oib.breakdown["activation"] + oib.breakdown["grad"] + oib.breakdown["temporary"]
        assert plain.peak.allocated_bytes - oib.peak.allocated_bytes >= saved - bound
        assert oib.peak.allocated_bytes < plain.peak.allocated_bytes


@pytest.mark.parametrize("s", [
    spec("tiny-llama"), spec("tiny-llava"),
    spec("tiny-llava", precision="bf16", grad_ckpt=True, micro_batch=2, seq_len=64),
    spec("tiny-llama", precision="bf16-mixed", micro_batch=2, seq_len=64),
], ids=["llama-fp32", "llava-fp32", "llava-bf16-ckpt", "llama-mixed"])
def test_analytic_within_3pct_of_trace(s):
    a, t = analytic(s), trace.estimate(s)
    rel = (a.peak.allocated_bytes - t.peak.allocated_bytes) / t.peak.allocated_bytes
    assert abs(rel) <= TOL, rel
    ta = a.peak.allocated_bytes - a.breakdown["workspace"]
    tt = t.peak.allocated_bytes - t.breakdown["workspace"]
    assert abs(ta - tt) / tt <= TOL, (ta, tt)


def test_analytic_within_3pct_of_trace_real_sized():
    """Llama-3.2-3B (tied embeddings), pure bf16, b1 s512: 29.98 GiB plain (step peak) ->
    20.64 GiB trace / 20.57 analytic in iteration 1's backward (docs/savers.md)."""
    s = TrainingSpec(model="llama-3.2-3b", micro_batch=1, seq_len=512, precision="bf16",
                     optimizer_in_backward=True)
    a, t = analytic(s), trace.estimate(s)
    assert t.peak.phase == a.peak.phase == "backward"
    assert abs(a.peak.allocated_bytes - t.peak.allocated_bytes) / t.peak.allocated_bytes <= TOL


def test_harness_cpu_stand_in_runs_it(stand_in_collect):
    """`collect` on the CPU stand-in probe: the job runs with the hooks, and its optimizer
    state (AdamW's two moments per parameter: the same bytes as the plain loop's) is counted
    through the per-parameter optimizers."""
    df = stand_in_collect("optimizer_in_backward = [false, true]").set_index("optimizer_in_backward")
    assert df.loc[True, "optimizer_state_bytes"] == df.loc[False, "optimizer_state_bytes"] > 0
