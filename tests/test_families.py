"""Decoder families with closed forms beyond Llama/Mistral/Qwen2 (docs/families.md).

Per family, on its tiny preset: the parameter count per part equals the transformers model
built on the meta device (tests/test_models.py does that for every preset, buffers too); the
trace tier equals a real (non-fake) CPU run's live bytes; the analytic tier is within `TOL` of
the trace tier (peak allocated, and its tensor part without the two cuBLAS workspaces), with
exact param / grad / optimizer bytes; and on one real-sized config per family, within `TOL` of
the trace tier's peak allocated. `predict` picks the analytic tier for these families.
"""

from __future__ import annotations

import pytest

from hybridmem import TrainingSpec
from hybridmem.analytic import estimate as analytic
from hybridmem.models import load_config
from hybridmem.analytic.scope import refusal
from hybridmem.predict import choose_method, predict
from hybridmem.job.spec import LoraSpec
from hybridmem.trace import estimate as traced, runner
from test_trace import real_cpu_peak

TOL = 0.03  # the bound on analytic vs trace (peak allocated)
TENSOR_TOL = 0.05  # test_analytic_vs_trace.TOL: tiny tensors are 512 B-rounded, few per layer
# tiny preset -> the runs the family supports (its transformers code refuses the others)
TINY = {"tiny-qwen3": {}, "tiny-phi3": {}, "tiny-gemma2": {"attn": "eager"},
        "tiny-gemma3-text": {}, "tiny-olmo2": {}}
GRID = [dict(precision=p, train=tr, grad_ckpt=c)
        for p in ("fp32", "bf16", "bf16-mixed") for tr in ("full", "lora") for c in (False, True)]
# MoE families: full bf16 only in the analytic tier (LoRA on the fused 3-D experts and other
# dtypes are refused: estimate.setup); micro-batch 1 and 2, with and without checkpointing
MOE = {"tiny-mixtral": {"precision": "bf16"}, "tiny-qwen3-moe": {"precision": "bf16"}}
MOE_GRID = [dict(micro_batch=b, grad_ckpt=c) for b in (1, 2) for c in (False, True)]
# one real-sized config per family: bf16 full fine-tuning with a backward peak
REAL = [dict(model="qwen3-0.6b", precision="bf16", micro_batch=1, seq_len=1024),
        dict(model="phi-3-mini-4k-instruct", precision="bf16", train="lora", lora=LoraSpec(r=16),
             micro_batch=1, seq_len=2048),
        # the newer families' real-sized checks run with `-m slow` (6-9 s each)
        pytest.param(dict(model="gemma-2-2b", attn="eager", precision="bf16", train="lora",
                          lora=LoraSpec(r=16), micro_batch=1, seq_len=2048),
                     marks=pytest.mark.slow),
        pytest.param(dict(model="qwen3-30b-a3b", precision="bf16", micro_batch=4,
                          seq_len=4096), marks=pytest.mark.slow),
        pytest.param(dict(model="gemma-3-1b-pt", precision="bf16", micro_batch=1,
                          seq_len=2048), marks=pytest.mark.slow),
        pytest.param(dict(model="olmo-2-1124-7b", precision="bf16", train="lora",
                          lora=LoraSpec(r=16), grad_ckpt=True, micro_batch=2, seq_len=2048),
                     marks=pytest.mark.slow)]


def _spec(model: str, **kw) -> TrainingSpec:
    if kw.get("train") == "lora":
        kw.setdefault("lora", LoraSpec(r=4))
    return TrainingSpec(**{"model": model, "micro_batch": 2, "seq_len": 64, **TINY.get(model, {}),
                           **MOE.get(model, {}), **kw})


def _ids(kw: dict) -> str:
    return "-".join(str(v) for v in kw.values())


@pytest.mark.compat
@pytest.mark.parametrize("model", sorted(TINY))
@pytest.mark.parametrize("kw", [dict(precision="fp32"),
                                dict(precision="fp32", train="lora", grad_ckpt=True)], ids=_ids)
def test_trace_equals_a_real_cpu_run(model, kw):
    spec = _spec(model, **kw)
    tracker, _ = runner.trace(spec, load_config(spec.model))
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(spec)


def _close(spec: TrainingSpec, tensor_tol: float | None) -> None:
    a, tr = analytic(spec), traced(spec)
    assert (a.params_total, a.params_trainable) == (tr.params_total, tr.params_trainable)
    assert a.breakdown["param"] == tr.breakdown["param"]
    am = {m.name: m for m in a.modules}
    for m in tr.modules:  # a tied lm_head has no row in the trace tier
        assert (am[m.name].grad, am[m.name].optimizer) == (m.grad, m.optimizer), m.name
    rel = a.peak.allocated_bytes / tr.peak.allocated_bytes - 1
    assert abs(rel) <= TOL, f"analytic {a.peak.allocated_bytes} vs trace {tr.peak.allocated_bytes}"
    if tensor_tol is not None:
        ta = a.peak.allocated_bytes - a.breakdown["workspace"]
        tt = tr.peak.allocated_bytes - tr.breakdown["workspace"]
        assert abs(ta / tt - 1) <= tensor_tol, f"tensor peak {ta} vs trace {tt}"


@pytest.mark.parametrize("model", sorted(TINY))
@pytest.mark.parametrize("kw", GRID, ids=_ids)
def test_analytic_matches_trace_on_tiny(model, kw):
    _close(_spec(model, **kw), TENSOR_TOL)


@pytest.mark.parametrize("kw", REAL, ids=lambda kw: kw["model"])
def test_analytic_matches_trace_real_sized(kw):
    _close(TrainingSpec(**kw), None)


@pytest.mark.parametrize("model", sorted(TINY))
def test_default_lora_targets_are_peft_all_linear(model):
    """The default targets mean all LLM linear layers: PEFT's own `all-linear` on the model
    built on the meta device is the reference (Phi-3's fused qkv_proj / gate_up_proj)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(load_config(model))
    ref = peft.get_peft_model(ref, peft.LoraConfig(r=4, target_modules="all-linear"))
    pred = analytic(_spec(model, train="lora"))
    assert (pred.params_total, pred.params_trainable) == (
        sum(p.numel() for p in ref.parameters()),
        sum(p.numel() for p in ref.parameters() if p.requires_grad))


@pytest.mark.parametrize("model", sorted(TINY))
def test_predict_picks_the_analytic_tier(model):
    assert refusal(_spec(model)) is None
    assert choose_method(_spec(model)).method in ("analytic", "hybrid")


@pytest.mark.parametrize("model", sorted(TINY))
def test_harness_default_lora_targets_match_both_tiers(model):
    """The CUDA harness's `add_lora` gives the default targets the same meaning as both tiers
    (the family's own linear names): its trainable count equals the analytic tier's."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybridmem.harness.workload import add_lora

    spec = _spec(model, train="lora")
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(load_config(model))
    for p in ref.parameters():
        p.requires_grad_(False)
    ref = add_lora(ref, spec)
    assert sum(p.numel() for p in ref.parameters() if p.requires_grad) == \
        analytic(spec).params_trainable


def test_gemma2_sdpa_is_refused_as_transformers_does():
    """Gemma2PreTrainedModel._supports_sdpa = False: both tiers give a one-line SpecError."""
    from hybridmem import SpecError

    with pytest.raises(SpecError, match=r"attn='sdpa'.*eager"):
        analytic(_spec("tiny-gemma2", attn="sdpa"))
    with pytest.raises(SpecError, match=r"attn='sdpa'"):
        traced(_spec("tiny-gemma2", attn="sdpa"))


@pytest.mark.parametrize("model", sorted(MOE))
def test_moe_trace_equals_a_real_cpu_run(model):
    spec = _spec(model)
    tracker, _ = runner.trace(spec, load_config(spec.model))
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(spec)


@pytest.mark.parametrize("model", sorted(MOE))
@pytest.mark.parametrize("kw", MOE_GRID, ids=_ids)
def test_moe_analytic_matches_trace_on_tiny(model, kw):
    _close(_spec(model, **kw), TENSOR_TOL)


@pytest.mark.parametrize("model", sorted(MOE))
def test_moe_predict_picks_the_analytic_tier_and_refuses_what_it_does_not_price(model):
    from hybridmem import SpecError

    assert refusal(_spec(model)) is None
    lora = _spec(model, train="lora", lora=LoraSpec(r=4))
    assert refusal(lora).field == "train"
    with pytest.raises(SpecError, match=r"^train='lora': adapters on .*fused 3-D experts"):
        analytic(lora)
    with pytest.raises(SpecError, match=r"precision='fp32'.*bf16"):
        analytic(_spec(model, precision="fp32"))


@pytest.mark.parametrize("model", sorted(MOE))
def test_moe_lora_refusal_names_a_tier_that_prices_it(model):
    """MoE + LoRA in bf16: the analytic tier refuses and points to the trace tier, which
    prices it; under bf16-mixed, or with kbit preparation's fp32 experts, no tier does, and the
    refusal says so (the hybrid tier too). Without a method the chooser takes the trace tier,
    with its note."""
    from hybridmem import SpecError

    lora = _spec(model, train="lora", lora=LoraSpec(r=4))
    with pytest.raises(SpecError, match=r"have no closed form here; use --method trace"):
        predict(lora, method="analytic")
    chosen = predict(lora)
    assert chosen.method == "trace" and chosen.peak == predict(lora, method="trace").peak
    assert any(n.startswith("method: trace chosen because the analytic tier refuses "
                            "train='lora'") for n in chosen.notes)
    for kw in (dict(precision="bf16-mixed"), dict(quantize="nf4")):
        spec = lora.with_(**kw)
        for method in (None, "analytic", "trace", "hybrid"):
            with pytest.raises(SpecError, match=r"; no tier prices this job \(the (analytic|trace) "
                                                r"tier: "):
                predict(spec, method=method)


def test_trace_scope_bf16_precisions_are_the_bf16_parameter_dtypes():
    import torch

    from hybridmem.torch_dtype import PARAM_DTYPE
    from hybridmem.trace.scope import BF16_PARAMS

    assert set(BF16_PARAMS) == {p for p, d in PARAM_DTYPE.items() if d == torch.bfloat16}
