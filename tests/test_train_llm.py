"""`train='llm'`: the language model alone, vision tower and projector frozen (LLaMA-Factory's
full fine-tuning of a VLM by default), priced by both tiers as the trace runs it."""

from __future__ import annotations

import pytest

from hybridmem.analytic import estimate as analytic
from hybridmem.errors import SpecError
from hybridmem.job.spec import TrainingSpec


def spec(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": "tiny-llava", "micro_batch": 2, "seq_len": 64,
                           "precision": "bf16-mixed", "attn": "sdpa", **kw})


def test_the_projector_is_what_llm_leaves_out():
    counts = {t: analytic(spec(train=t)).params_trainable
              for t in ("llm", "llm+projector", "projector")}
    assert counts["llm"] == counts["llm+projector"] - counts["projector"] > 0


@pytest.mark.parametrize("kw", [dict(), dict(grad_ckpt=True)])
def test_llm_analytic_matches_trace(kw):
    trace = pytest.importorskip("hybridmem.trace")
    s = spec(train="llm", **kw)
    a, tr = analytic(s), trace.estimate(s)
    assert a.params_trainable == tr.params_trainable
    assert (a.breakdown["param"], a.breakdown["optimizer"]) == (
        tr.breakdown["param"], tr.breakdown["optimizer"])
    ta = a.peak.allocated_bytes - a.breakdown["workspace"]
    tt = tr.peak.allocated_bytes - tr.breakdown["workspace"]
    assert abs(ta - tt) / tt <= 0.05  # the analytic-vs-trace tolerance (test_analytic_vs_trace)


def test_llm_needs_a_vision_tower():
    with pytest.raises(SpecError, match="^train"):
        analytic(spec(model="tiny-llama", train="llm"))


def test_llm_trace_equals_real_cpu_run():
    pytest.importorskip("torch")
    from test_trace import real_cpu_peak

    from hybridmem.models import load_config
    from hybridmem.trace import runner

    s = spec(train="llm", precision="bf16")
    job = runner.prepare(s, load_config(s.model))
    trained = {n.split(".")[1] if n.startswith("model.") else n.split(".")[0]
               for n, p in job.model.named_parameters() if p.requires_grad}
    assert "multi_modal_projector" not in trained and "vision_tower" not in trained
    tracker, _ = runner.trace(s, load_config(s.model))
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(s)
