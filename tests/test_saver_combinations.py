"""The common squeeze stack — QLoRA (nf4) + checkpointing + paged 8-bit AdamW + Liger — priced
by both tiers together, and the analytic tier within 3 % of the trace tier (the trace tier
equals real CPU runs for each technique on its own: tests/test_quantize.py, test_loss.py,
test_optimizers.py)."""

from __future__ import annotations

import pytest

from hybridmem.predict import predict
from hybridmem.job.spec import TrainingSpec

STACK = dict(train="lora", grad_ckpt=True, quantize="nf4", optimizer="paged-adamw-8bit",
             liger=True)


@pytest.mark.parametrize("model, batch, seq, precision", [
    ("tiny-llama", 2, 128, "bf16"),
    ("tiny-llama", 2, 128, "bf16-mixed"),
    ("llama-3.2-3b", 2, 1024, "bf16-mixed"),  # fast trace path: ~10 s
])
def test_stack_analytic_within_3pct_of_trace(model, batch, seq, precision):
    spec = TrainingSpec(model=model, micro_batch=batch, seq_len=seq, precision=precision, **STACK)
    a, t = predict(spec, method="analytic"), predict(spec, method="trace")
    assert abs(a.peak.allocated_bytes / t.peak.allocated_bytes - 1) < 0.03
    assert a.peak.phase == t.peak.phase
    # both agree on what is paged (bitsandbytes pages states of >= 1e5 elements only: none of
    # these LoRA r=8 tensors) and on the trainable count (no grads of the quantised base)
    assert a.paged_bytes == t.paged_bytes
    assert (a.params_trainable, a.params_total) == (t.params_trainable, t.params_total)


def test_stack_less_than_each_step_before_it():
    """Each switch lowers the analytic peak of llama-3.2-3b, 2 x 1024, bf16-mixed LoRA + ckpt."""
    base = dict(model="llama-3.2-3b", micro_batch=2, seq_len=1024, precision="bf16-mixed",
                train="lora", grad_ckpt=True)
    steps = [{}, {"quantize": "nf4"}, {"quantize": "nf4", "optimizer": "paged-adamw-8bit"},
             {"quantize": "nf4", "optimizer": "paged-adamw-8bit", "liger": True}]
    peaks = [predict(TrainingSpec(**base, **s), method="analytic").peak.allocated_bytes
             for s in steps]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)
