"""TrainingSpec validation: one-line errors naming field, value and choices."""

from __future__ import annotations

import json

import pytest

from hybridmem.errors import SpecError
from hybridmem.models import load_config, preset_names
from hybridmem.models.loader import SUPPORTED_TYPES, transformers_types
from hybridmem.job.spec import LoraSpec, ParallelSpec, TrainingSpec


def test_defaults_and_roundtrip():
    spec = TrainingSpec(model="tiny-llava", train="lora")
    assert spec.lora == LoraSpec()
    assert TrainingSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@pytest.mark.parametrize("field,value,match", [
    ("micro_batch", 0, r"micro_batch=0: must be a positive integer"),
    ("micro_batch", -3, r"micro_batch=-3"),
    ("seq_len", 0, r"seq_len=0"),
    ("precision", "int3", r"precision='int3' is not valid \(valid: fp32, bf16, fp16, bf16-mixed"),
    ("optimizer", "adam", r"optimizer='adam' is not valid \(valid: adamw, adamw-fused"),
    ("train", "vision", r"train='vision' is not valid \(valid: full, llm\+projector"),
    ("attn", "flash", r"attn='flash' is not valid \(valid: eager, sdpa, flash_attention_2\)"),
    ("image_size", -1, r"image_size=-1"),
    ("images_per_sample", -1, r"images_per_sample=-1"),
])
def test_bad_fields(field, value, match):
    with pytest.raises(SpecError, match=match):
        TrainingSpec(model="tiny-llava", **{field: value})


def test_impossible_pair_names_valid_optimizers():
    with pytest.raises(SpecError, match=r"optimizer='lora-fa': not available with "
                       r"precision='bf16-master'.*\(valid: adamw, adamw-fused, adamw-8bit"):
        TrainingSpec(model="tiny-llava", train="lora", precision="bf16-master",
                     optimizer="lora-fa")
    # bnb 8-bit state over DeepSpeed's fp32 master partition is a client optimizer ZeRO wraps
    TrainingSpec(model="tiny-llava", precision="bf16-master", optimizer="adamw-8bit")


def test_lora_settings_need_lora_training():
    with pytest.raises(SpecError, match=r"lora="):
        TrainingSpec(model="tiny-llava", train="full", lora=LoraSpec(r=4))
    with pytest.raises(SpecError, match=r"lora.r=0"):
        LoraSpec(r=0)


def test_parallel_validation():
    with pytest.raises(SpecError, match=r"parallel.world_size=0"):
        ParallelSpec(world_size=0)


def test_unknown_field_in_dict():
    with pytest.raises(SpecError, match=r"spec='batch': unknown field"):
        TrainingSpec.from_dict({"model": "x", "batch": 3})


def test_presets_load_and_unknowns_fail(tmp_path):
    for name in preset_names():
        # a preset is an analytic family or one transformers builds (trace tier only)
        kind = load_config(name).model_type
        assert kind in SUPPORTED_TYPES or kind in transformers_types()
    with pytest.raises(SpecError, match=r"model='nope': unknown preset \(valid: .*llava-1.5-7b"):
        load_config("nope")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(SpecError, match=r"malformed JSON at line 1"):
        load_config(str(bad))
    with pytest.raises(SpecError, match=r"malformed JSON"):
        load_config(str(tmp_path))  # a folder holding config.json
    bad.write_text(json.dumps({"model_type": "no_such_family"}))  # gpt2 is a trace-tier family
    with pytest.raises(SpecError, match=r"model_type='no_such_family' is not valid \(valid: .*llava, llava_next, .*llama"):
        load_config(str(bad))
