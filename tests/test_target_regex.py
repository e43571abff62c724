"""LoRA targets given as one string are peft's regex, and attention implementations follow the
installed transformers' class declarations (issue #34).

The regex rule is checked against peft itself: the same `target_modules` string on the same
model, built by transformers from the tiny preset's config, must adapt the same modules in the
analytic graph as `peft.get_peft_model` does. The attention rule is checked against the class
attributes transformers exposes once imported.
"""

from __future__ import annotations

import pytest

from hybridmem.errors import SpecError
from hybridmem.job.spec import LoraSpec, TrainingSpec
from hybridmem.models.build import build_graph

# axolotl's examples/qwen2_5-vl/lora-7b.yaml `lora_target_modules`
AXOLOTL_VL = r"model.language_model.layers.[\d]+.(mlp|cross_attn|self_attn).(up|down|gate|q|k|v|o)_proj"


def _graph_targets(spec: TrainingSpec) -> set[str]:
    """Full module names the analytic graph puts an adapter on."""
    out = set()
    for m in build_graph(spec).modules:
        for layer in m.layers:
            for t in layer.lora:
                if ".lora_A." in t.name or t.name.startswith("lora_A."):
                    linear = t.name.split(".lora_A.")[0] if ".lora_A." in t.name else ""
                    out.add(".".join(x for x in (m.prefix, layer.scope, linear) if x))
    return out


def _peft_targets(model_name: str, target_modules) -> set[str]:
    import peft
    import torch
    from transformers import AutoModelForImageTextToText

    from hybridmem.models.loader import load_config

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(load_config(model_name))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=target_modules))
    return set(wrapped.base_model.targeted_module_names)


@pytest.mark.parametrize("pattern", [
    AXOLOTL_VL,
    r".*\.self_attn\.(q|v)_proj",                  # attention only
    r"model\.language_model\.layers\.0\..*_proj",  # one layer
])
def test_regex_targets_match_peft_on_a_real_model(pattern):
    spec = TrainingSpec(model="tiny-qwen2.5-vl", train="lora", seq_len=512,
                        lora=LoraSpec(target_regex=pattern))
    ours = _graph_targets(spec)
    assert ours and ours == _peft_targets("tiny-qwen2.5-vl", pattern)


def test_a_regex_that_peft_matches_nowhere_is_one_line():
    """transformers 5 names the LM `model.language_model`; axolotl's older gemma3 example's
    `language_model.model.layers...` full-matches nothing, as peft finds (it raises)."""
    old = AXOLOTL_VL.replace("model.language_model", "language_model.model")
    with pytest.raises(ValueError):
        _peft_targets("tiny-qwen2.5-vl", old)
    with pytest.raises(SpecError, match=r"^lora.target_regex=.*full-matches it against whole "
                                        r"module names, such as 'model\.language_model\.layers"):
        build_graph(TrainingSpec(model="tiny-qwen2.5-vl", train="lora", seq_len=512,
                                 lora=LoraSpec(target_regex=old)))


def test_a_regex_reaching_the_vision_tower_is_refused_by_the_closed_forms():
    with pytest.raises(SpecError, match=r"also adapts model\.visual\..*--method trace"):
        build_graph(TrainingSpec(model="tiny-qwen2.5-vl", train="lora", seq_len=512,
                                 lora=LoraSpec(target_regex=r".*proj|.*qkv")))


def test_a_bad_regex_is_one_line():
    with pytest.raises(SpecError, match=r"^lora.target_regex='\(': not a regular expression"):
        LoraSpec(target_regex="(")


def test_peft_config_string_target_modules_is_the_regex():
    from hybridmem.adapters import spec_fields

    fields = spec_fields({"peft_type": "LORA", "r": 4, "target_modules": AXOLOTL_VL})
    assert fields["train"] == "lora" and fields["lora"].target_regex == AXOLOTL_VL
    assert spec_fields({"peft_type": "LORA", "target_modules": "all-linear"})[
        "lora"].target_regex is None


# --- attention implementations, as the installed transformers declares them ----------------

@pytest.mark.parametrize("model_type, kind, cls", [
    ("gemma3", "vlm", "Gemma3ForConditionalGeneration"), ("gemma2", "decoder", "Gemma2ForCausalLM"),
    ("llama", "decoder", "LlamaForCausalLM"), ("qwen2_5_vl", "vlm",
                                               "Qwen2_5_VLForConditionalGeneration"),
    ("gemma3_text", "decoder", "Gemma3ForCausalLM"), ("idefics3", "vlm",
                                                      "Idefics3ForConditionalGeneration"),
])
def test_declared_attention_equals_the_imported_class(model_type, kind, cls):
    import transformers

    from hybridmem.families.attention import declared

    name, allowed = declared(model_type, kind)
    klass = getattr(transformers, cls)
    assert name == cls
    assert allowed == {"flash_attention_2": bool(klass._supports_flash_attn),
                       "sdpa": bool(klass._supports_sdpa)}


def test_refused_attention_names_the_class_attribute():
    with pytest.raises(SpecError, match=r"^attn='flash_attention_2': transformers' gemma3 code "
                                        r"does not support it \(Gemma3ForConditionalGeneration"
                                        r"\._supports_flash_attn is False.*\(valid: eager, sdpa\)"):
        build_graph(TrainingSpec(model="tiny-gemma3", seq_len=64, attn="flash_attention_2"))
    build_graph(TrainingSpec(model="tiny-qwen2.5-vl", seq_len=512, attn="flash_attention_2"))
