"""Defaults that follow the model (hybridmem.families.defaults): the attention implementation
transformers picks, the precision a model is loaded and trained in; explicit values win."""

from __future__ import annotations

import dataclasses

import pytest

from hybridmem import SpecError, TrainingSpec, predict
from hybridmem.families.defaults import default_attn, resolve_defaults
from hybridmem.job.schema import echo_lines


def _peak(spec: TrainingSpec) -> int:
    return predict(spec, method="analytic").peak.device_bytes


@pytest.mark.parametrize("model_type,cls", [("gemma2", "Gemma2ForCausalLM"),
                                            ("llama", "LlamaForCausalLM")])
def test_attention_default_is_what_transformers_picks(model_type, cls):
    import transformers

    # PreTrainedModel.get_correct_attn_implementation: None -> sdpa, eager when the class
    # cannot dispatch SDPA (`_supports_sdpa`)
    want = "sdpa" if getattr(transformers, cls)._supports_sdpa else "eager"
    assert default_attn(model_type)[0] == want


def test_gemma2_prices_by_default_and_still_refuses_an_explicit_sdpa():
    spec = TrainingSpec(model="tiny-gemma2", seq_len=64)
    pred = predict(spec, method="analytic")
    assert pred.job["attn"] == "eager" and "attn" in pred.job["defaults"]
    assert any(n.startswith("attn=eager") for n in pred.notes)
    assert pred.peak.device_bytes == _peak(spec.with_(attn="eager"))
    with pytest.raises(SpecError, match="attn"):
        predict(spec.with_(attn="sdpa"), method="analytic")


def test_lora_default_is_the_checkpoint_dtype_and_full_is_bf16_mixed():
    # llama-3.2-3b's config.json: torch_dtype bfloat16 (transformers 5 loads it so, dtype="auto")
    lora = TrainingSpec(model="llama-3.2-3b", train="lora", seq_len=256)
    assert resolve_defaults(lora).spec.precision == "bf16"
    assert _peak(lora) == _peak(lora.with_(precision="bf16"))
    full = TrainingSpec(model="llama-3.2-3b", seq_len=256)
    assert resolve_defaults(full).spec.precision == "bf16-mixed"
    assert _peak(full) == _peak(full.with_(precision="bf16-mixed"))


def test_explicit_values_are_never_replaced():
    spec = TrainingSpec(model="tiny-gemma2", train="lora", precision="fp32", attn="eager")
    out = resolve_defaults(spec)
    # a resolved `Job` (job/resolved.py) with every field as given
    assert dataclasses.asdict(out.spec) == dataclasses.asdict(spec) and out.defaults == {}


def test_echo_states_the_precision_in_words():
    job = predict(TrainingSpec(model="llama-3.2-3b", train="lora", seq_len=256),
                  method="analytic").job
    text = "\n".join(echo_lines(job))
    assert "weights bf16, compute bf16, adapters fp32 (peft), no master copy" in text
    assert "default precision=bf16" in text
