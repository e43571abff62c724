"""Packed / padding-free batches (`--packing`, hybridmem/techniques/packing.py).

Oracles: a real CPU run of the same packed batch (the trace tier must equal its live bytes);
a hand count of what the packed row adds to the same tokens as one unpacked row (position ids,
sdpa's L x L bias per layer); the trace tier for the analytic one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridmem import TrainingSpec
from hybridmem.analytic.estimate import estimate as analytic
from hybridmem.errors import SpecError
from hybridmem.models import load_config
from hybridmem.intake.merge import spec_from_inputs

trace = pytest.importorskip("hybridmem.trace")
from hybridmem.trace import runner  # noqa: E402

from test_trace import real_cpu_peak, rounded  # noqa: E402

TOL = 0.03  # analytic vs trace, allocated peak (the brief's bound)


def spec(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": "tiny-llama", "micro_batch": 4, "seq_len": 64,
                           "precision": "fp32", "optimizer": "sgd", "packing": True, **kw})


def test_default_keeps_the_spec_hash():
    assert "packing" not in spec(packing=False).to_dict()
    assert TrainingSpec.from_dict(spec().to_dict()) == spec()
    with pytest.raises(SpecError) as err:
        spec(packing="yes")
    assert err.value.field == "packing"


def test_multimodal_packing_exits_2_naming_it():
    proc = subprocess.run([sys.executable, "-m", "hybridmem.cli", "predict", "--model",
                           "tiny-llava", "--seq-len", "64", "--method", "analytic",
                           "--packing"], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: packing=True") and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("key", ["padding_free", "packing"])
def test_sft_config_keys_give_the_flag(key):
    """TRL SFTConfig `padding_free` / `packing` (+ gradient_checkpointing_kwargs) = the flags."""
    over = {"model": "tiny-llama", "seq_len": 64, "micro_batch": 4}
    a = spec_from_inputs(training_args={key: True, "max_grad_norm": 0.0,
                                        "gradient_checkpointing": True,
                                        "gradient_checkpointing_kwargs": {"every_n_layers": 2}},
                         overrides=over)
    b = spec_from_inputs(overrides={**over, "packing": True, "grad_ckpt": True,
                                    "grad_ckpt_policy": "every:2"})
    assert a == b
    assert analytic(a).peak.allocated_bytes == analytic(b).peak.allocated_bytes


@pytest.mark.parametrize("kw", [dict(), dict(attn="eager"),
                                dict(precision="bf16-mixed", grad_ckpt=True)])
def test_trace_equals_real_cpu_run(kw):
    s = spec(**kw)
    tracker, job = runner.trace(s, load_config(s.model))
    assert tuple(job.batch["input_ids"].shape) == (1, 256)
    assert int(tracker.live_curve().max()) == real_cpu_peak(s)


def _forward_end(s: TrainingSpec) -> int:
    tr, _ = runner.trace(s, load_config(s.model))
    at = next(i for i, p, it in tr.marks if p == "backward" and it == 1)
    return int(tr.live_curve()[at - 1])


def test_packed_row_costs_by_hand():
    """Against the same 256 tokens as one unpacked row, at the end of iteration 1's forward:
    sdpa adds the (1, 256) int64 position ids and per decoder layer (tiny-llama: 2) the bool
    block-diagonal mask converted to an fp32 L x L bias that SDPA saves (attention.cpp
    `convert_boolean_attn_mask`), and, the mask turning transformers' GQA-in-SDPA off
    (`use_gqa_in_sdpa`), k and v repeated to all 4 heads instead of the 2 kv heads (tiny-llama
    preset: 4 heads, 2 kv heads, head_dim 16): 2 x L x (64 - 32) x 4 B more per layer; eager's
    float mask and repeat_kv exist unpacked too, so only the position ids are added."""
    L = 256
    one = dict(packing=False, micro_batch=1, seq_len=L)
    gqa = 2 * (L * 64 * 4 - L * 32 * 4)
    assert (_forward_end(spec()) - _forward_end(spec(**one))
            == rounded(L * 8) + 2 * (L * L * 4 + gqa))
    assert (_forward_end(spec(attn="eager")) - _forward_end(spec(attn="eager", **one))
            == rounded(L * 8))


def test_eager_note_says_quadratic():
    notes = analytic(spec(attn="eager")).notes
    assert any("quadratic" in n for n in notes)


@pytest.mark.parametrize("kw", [dict(), dict(attn="eager"), dict(grad_ckpt=True),
                                dict(precision="bf16-mixed", seq_len=128),
                                dict(precision="bf16-mixed", seq_len=128, attn="eager")])
def test_analytic_within_3pct_of_trace_tiny(kw):
    s = spec(**kw)
    a, t = analytic(s), trace.estimate(s)
    assert abs(a.peak.allocated_bytes - t.peak.allocated_bytes) / t.peak.allocated_bytes <= TOL


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_analytic_within_3pct_of_trace_real_sized(attn):
    """Llama-3.2-3B, LoRA, bf16-mixed, adamw-fused, 4 x 1024 tokens packed (docs/savers.md)."""
    s = TrainingSpec(model="llama-3.2-3b", micro_batch=4, seq_len=1024, precision="bf16-mixed",
                     optimizer="adamw-fused", train="lora", attn=attn, packing=True)
    a, t = analytic(s), trace.estimate(s)
    assert abs(a.peak.allocated_bytes - t.peak.allocated_bytes) / t.peak.allocated_bytes <= TOL


def test_harness_cpu_stand_in_runs_it(stand_in_collect):
    df = stand_in_collect("micro_batch = [2]\npacking = [false, true]")
    assert sorted(df["packing"]) == [False, True]


def test_meta_backend_equals_real_cpu_run():
    """The default backend (meta: SDPA redirected to the CPU flash kernel) converts the packed
    bool mask as aten's SDPA entry does, so it equals the real run too (fp32: no autocast)."""
    s = spec()
    tracker, _ = runner.trace(s, load_config(s.model), backend="meta")
    assert int(tracker.live_curve().max()) == real_cpu_peak(s)
