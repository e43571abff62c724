"""Liger's fused linear preference losses (`--liger` with DPO / ORPO,
`hybridmem.techniques.liger_preference`): the head's tensors by hand, the analytic tier's
answer without full logits, and the objectives it is not priced with still refused."""

from __future__ import annotations

import pytest

from hybridmem import TrainingSpec
from hybridmem.analytic import estimate as analytic
from hybridmem.errors import SpecError
from hybridmem.techniques import trl_head_runs, head_of, liger_preference


def test_head_tensors_by_hand():
    # R=4 rows (2 pairs) of S=8 tokens, H=16, V=32, bf16 everywhere, a reference model;
    # chunk_size=1 pair: r=2 rows, 16 tokens a chunk (fused_linear_preference.py)
    ts = liger_preference.tensors(4, 8, 16, 32, 2, 2, 2, reference=True)
    # saved: the concatenated input grads (4*8*16 bf16) and grad_weight (32*16 bf16)
    assert ts["saved"] == [(512, 2), (512, 2)]
    assert ts["grad_in_saved"] == [(512, 2)]
    # the chunk's logits (16*32 bf16 = 1024 B) and fp32 log-probs (2048 B), then its backward
    # (two fp32 16*32 grads: 4096 B, its input grad 16*16 bf16: 512 B, its weight grad
    # 32*16 bf16: 1024 B = 5632 B) beats the reference chunk (3072 B): 8704 B in all, above the
    # final concatenation's list (4*8*16 bf16 = 1024 B)
    fwd = ts["fwd"]
    assert sum(n * b for n, b in fwd) == 1024 + 2048 + 5632


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_the_analytic_tier_prices_the_fused_preference_loss(objective):
    kw = dict(model="llama-3.2-3b", micro_batch=2, seq_len=1024, precision="bf16",
              objective=objective, train="lora")
    plain, fused = analytic(TrainingSpec(**kw)), analytic(TrainingSpec(**kw, liger=True))
    if trl_head_runs(TrainingSpec(**kw)):
        # the installed TRL runs DPO through its own fused head and, under use_liger_kernel,
        # applies Liger's layer kernels only (trl 1.16 dpo_trainer.py): no Liger DPO loss
        assert head_of(TrainingSpec(**kw, liger=True)) is None
        assert fused.peak.allocated_bytes < plain.peak.allocated_bytes  # the layer kernels
        assert not any("LigerFusedLinear" in n for n in fused.notes)
        return
    assert head_of(TrainingSpec(**kw, liger=True)) is liger_preference
    # no (2 x micro-batch, S, V) logits: llama-3.2-3b's 128256-token vocabulary costs less
    assert fused.peak.allocated_bytes < plain.peak.allocated_bytes
    assert any(f"LigerFusedLinear{objective.upper()}Loss" in n for n in fused.notes)


def test_other_objectives_and_the_trace_tier_refuse_it_in_one_line():
    with pytest.raises(SpecError) as err:
        TrainingSpec(model="tiny-llama", objective="kto", liger=True)
    assert err.value.field == "liger" and "\n" not in str(err.value)
    from hybridmem.predict import predict

    spec = TrainingSpec(model="tiny-llama", seq_len=64, precision="bf16", objective="dpo",
                        liger=True)
    with pytest.raises(SpecError) as err:
        predict(spec, method="trace")
    assert "analytic" in str(err.value) and "\n" not in str(err.value)
