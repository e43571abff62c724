"""Op-level selective checkpointing (`--grad-ckpt-policy ops`, hybridmem/techniques/sac.py).

Oracles: a hand count of the tensors torchtitan's policy keeps per layer (against full
checkpointing, at the end of the forward); a real CPU run of the same policy (the trace tier
must equal its live bytes); the trace tier for the analytic one.
"""

from __future__ import annotations

import pytest
import torch

from hybridmem import TrainingSpec
from hybridmem.analytic.estimate import estimate as analytic
from hybridmem.errors import SpecError
from hybridmem.models import load_config

trace = pytest.importorskip("hybridmem.trace")
from hybridmem.trace import runner  # noqa: E402

from test_trace import real_cpu_peak  # noqa: E402

TOL = 0.03


def spec(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": "tiny-llama", "micro_batch": 2, "seq_len": 64,
                           "precision": "fp32", "optimizer": "sgd", "grad_ckpt": True,
                           "grad_ckpt_policy": "ops", **kw})


def _forward_end(s: TrainingSpec) -> int:
    tr, _ = runner.trace(s, load_config(s.model))
    at = next(i for i, p, it in tr.marks if p == "backward" and it == 1)
    return int(tr.live_curve()[at - 1])


def test_kept_set_by_hand():
    """tiny-llama preset (hidden 64, 4 heads x 16, 2 kv heads, ffn 128), 2 x 64 = 128 tokens,
    fp32: per layer the outputs of the 1st, 3rd, 5th, 7th mm (q 128x64, v 128x32, gate 128x128,
    down 128x64) and SDPA's out (128x64) and logsumexp (2 x 4 heads x 64 rows) -- 2 layers."""
    B = 128
    per_layer = 4 * (B * 64 + B * 32 + B * 128 + B * 64 + B * 64) + 4 * 2 * 4 * 64
    assert _forward_end(spec()) - _forward_end(spec(grad_ckpt_policy="full")) == 2 * per_layer


def test_policy_counts_mms_per_region():
    """The policy's own decisions on one Llama layer's forward: of 7 mms, 4 saved."""
    from torch.utils.checkpoint import checkpoint

    from hybridmem.techniques import sac

    lin = [torch.nn.Linear(8, 8, bias=False) for _ in range(7)]
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func == torch.ops.aten.mm.default:
                seen.append(out.untyped_storage())
            return out

    def block(x):
        for m in lin:
            x = m(x)
        return x

    x = torch.randn(4, 8, requires_grad=True)
    with Spy():
        y = checkpoint(block, x, use_reentrant=False, context_fn=sac.context_fn)
        assert len(seen) == 7
        y.sum().backward()  # the recompute takes the 4 saved from the cache, recomputes 3
    assert len(seen) - 7 - 3 == 2 * 7  # + each linear's two backward mms (grad in, grad w)


@pytest.mark.parametrize("kw", [dict(), dict(attn="eager"),
                                dict(precision="bf16-mixed"),
                                dict(model="tiny-llava", precision="bf16-mixed")])
def test_trace_equals_real_cpu_run(kw):
    s = spec(**kw)
    tracker, _ = runner.trace(s, load_config(s.model))
    assert int(tracker.live_curve().max()) == real_cpu_peak(s)


@pytest.mark.parametrize("kw", [dict(), dict(attn="eager"), dict(precision="bf16-mixed",
                                micro_batch=4, seq_len=128), dict(model="tiny-llava",
                                precision="bf16-mixed", seq_len=128)])
def test_analytic_within_3pct_of_trace_tiny(kw):
    s = spec(**kw)
    a, t = analytic(s), trace.estimate(s)
    assert abs(a.peak.allocated_bytes - t.peak.allocated_bytes) / t.peak.allocated_bytes <= TOL


def test_analytic_within_3pct_of_trace_real_sized():
    """Llama-3.2-3B, full fine-tune, pure bf16, SGD, b4 s2048 (docs/savers.md)."""
    s = TrainingSpec(model="llama-3.2-3b", micro_batch=4, seq_len=2048, precision="bf16",
                     optimizer="sgd", grad_ckpt=True, grad_ckpt_policy="ops")
    a, t = analytic(s), trace.estimate(s)
    assert abs(a.peak.allocated_bytes - t.peak.allocated_bytes) / t.peak.allocated_bytes <= TOL
    full = trace.estimate(s.with_(grad_ckpt_policy="full"))
    assert full.peak.allocated_bytes < t.peak.allocated_bytes


def test_lora_is_trace_only_in_one_line():
    with pytest.raises(SpecError) as err:
        analytic(spec(train="lora"))
    assert err.value.field == "grad_ckpt_policy" and "\n" not in str(err.value)


def test_harness_builds_it_on_cpu():
    """The harness's model (workload.prepare: the same enable_checkpointing) runs a step."""
    from hybridmem.harness import workload

    s = spec()
    dev = torch.device("cpu")
    job = workload.prepare(s, load_config(s.model), dev)
    loss = workload.forward(job, s, dev)
    workload.backward(job, loss, s)
    workload.optimizer_step(job, s)


@pytest.mark.parametrize("kw", [
    dict(offload_activations="all", packing=True),
    dict(offload_activations="ckpt-inputs", packing=True, optimizer_in_backward=True),
    dict(offload_activations="all", optimizer_in_backward=True, attn="eager"),
])
def test_combinations_trace_equals_real_cpu_run_and_analytic_within_3pct(kw):
    """The savers together (ops checkpointing + offloading + packing + optimizer-in-backward)."""
    s = spec(micro_batch=4, **kw)
    tracker, _ = runner.trace(s, load_config(s.model))
    assert int(tracker.live_curve().max()) == real_cpu_peak(s)
    a, t = analytic(s), trace.estimate(s)
    assert abs(a.peak.allocated_bytes - t.peak.allocated_bytes) / t.peak.allocated_bytes <= TOL
