"""The trace tier's fast path (trace a few layers, repeat their pattern) equals the full trace.

The oracle is the full trace (`HYBRIDMEM_TRACE_FULL=1`), itself checked against real CPU runs
byte for byte in tests/test_trace.py and tests/test_generic.py. Tiny presets with their layer
counts raised (the fast path needs more layers than it traces: 6 + 7 per stack at period 1).
"""

from __future__ import annotations

import json

import pytest

from hybridmem.models.loader import load_config, load_config_dict
from hybridmem.job.spec import TrainingSpec
from hybridmem.trace import estimate, repeat


def _config(tmp_path, name: str, text: int, vision: int | None = None) -> str:
    data = load_config_dict(name)[1]
    if "text_config" in data:
        data["text_config"]["num_hidden_layers"] = text
        data["vision_config"]["num_hidden_layers"] = vision
    else:
        data["num_hidden_layers"] = text
    path = tmp_path / f"{name}-{text}-{vision}.json"
    path.write_text(json.dumps(data))
    return str(path)


def _both(spec: TrainingSpec, monkeypatch):
    monkeypatch.setenv(repeat.FULL_ENV, "1")
    full = estimate(spec)
    monkeypatch.setenv(repeat.FULL_ENV, "0")
    fast = estimate(spec)
    return full, fast


def _same(full, fast) -> None:
    assert fast.peak == full.peak
    assert fast.breakdown == full.breakdown
    assert fast.modules == full.modules
    assert fast.extras == full.extras  # events, peak event, by phase, by module, allocator
    assert (fast.params_total, fast.params_trainable) == (full.params_total,
                                                          full.params_trainable)


def _fast_taken(pred) -> bool:
    return any("layers traced" in n for n in pred.notes)


CASES = {  # id: (preset, text layers, vision layers, spec fields)
    "llama-ckpt-10": ("tiny-llama", 10, None, {"grad_ckpt": True}),
    "llama-every2-12": ("tiny-llama", 12, None, {"grad_ckpt": True,
                                                 "grad_ckpt_policy": "every:2"}),
    "llama-lora": ("tiny-llama", 9, None, {"train": "lora"}),
    "llama-accum2-custom": ("tiny-llama", 9, None, {"grad_accum": 2, "loop": "custom"}),
    "llava": ("tiny-llava", 8, 9, {}),
    "llava-ckpt-projector": ("tiny-llava", 9, 8, {"grad_ckpt": True,
                                                  "train": "llm+projector"}),
    # the memory savers on the fast path: each is a per-layer pattern too
    "llama-qlora-ckpt": ("tiny-llama", 9, None, {"train": "lora", "quantize": "nf4",
                                                 "grad_ckpt": True, "precision": "bf16"}),
    "llama-liger": ("tiny-llama", 9, None, {"liger": True}),
    "llama-chunked-ce": ("tiny-llama", 9, None, {"chunked_ce": 4}),
    "llama-paged-8bit": ("tiny-llama", 9, None, {"optimizer": "paged-adamw-8bit"}),
    "llama-in-backward": ("tiny-llama", 9, None, {"optimizer_in_backward": True}),
}


@pytest.mark.parametrize("case", CASES)
def test_fast_path_equals_full_trace(case, tmp_path, monkeypatch):
    preset, text, vision, fields = CASES[case]
    spec = TrainingSpec(model=_config(tmp_path, preset, text, vision), micro_batch=2,
                        seq_len=64, **fields)
    full, fast = _both(spec, monkeypatch)
    assert _fast_taken(fast), fast.notes  # the fast path ran (no fallback) ...
    assert not _fast_taken(full)
    _same(full, fast)  # ... and gave the full trace's numbers


def test_layer_count_dependent_sizes_fall_back(tmp_path, monkeypatch):
    """Clipping stacks one norm per parameter (`clip_grad_norm_`'s torch.stack, CUDA's
    `_foreach_norm` scratch): a non-layer size that grows with the layer count, which the
    check against the longer trace catches; the full trace answers."""
    spec = TrainingSpec(model=_config(tmp_path, "tiny-llama", 9), micro_batch=2, seq_len=64,
                        max_grad_norm=1.0)
    full, fast = _both(spec, monkeypatch)
    assert not _fast_taken(fast)
    assert any("every layer traced (the repeated pattern does not reproduce" in n
               for n in fast.notes)
    _same(full, fast)


def test_layers_that_differ_are_not_repeated(tmp_path):
    import transformers

    first_full = transformers.Qwen2Config(  # Qwen2 `max_window_layers` style: no period
        num_hidden_layers=12, layer_types=["full_attention"] * 4 + ["sliding_attention"] * 8)
    with pytest.raises(repeat.NotRepeatable, match="layer_types differs between layers"):
        repeat.plan(TrainingSpec(model="tiny-llama"), first_full)
    moe = transformers.Qwen3MoeConfig(num_hidden_layers=12, mlp_only_layers=[0])
    with pytest.raises(repeat.NotRepeatable, match="dense and sparse layers differ"):
        repeat.plan(TrainingSpec(model="tiny-llama"), moe)
    few = load_config(_config(tmp_path, "tiny-llama", 6))
    with pytest.raises(repeat.NotRepeatable, match="too few layers"):
        repeat.plan(TrainingSpec(model="tiny-llama"), few)


def test_plan_keeps_the_checkpointing_phase(tmp_path):
    """`every:N` checkpoints layers 0, N, 2N, ... of the whole model: the traced count is the
    full count mod N, so every traced layer has its full-model counterpart's status."""
    config = load_config(_config(tmp_path, "tiny-llama", 19))
    spec = TrainingSpec(model="tiny-llama", grad_ckpt=True, grad_ckpt_policy="every:3")
    (stack,) = repeat.plan(spec, config)
    assert stack.period == 3 and (stack.full - stack.traced) % 3 == 0
    assert stack.start == repeat.FIRST + repeat.BEFORE * 3 and stack.traced < stack.full


def _family_config(tmp_path, name: str, text: int, vision: int | None, edit=None) -> str:
    """A tiny preset (hand-made) with its stacks lengthened; `edit` changes it further."""
    data = load_config_dict(name)[1]
    tc = data.get("text_config", data)
    tc["num_hidden_layers"] = text
    tc.pop("layer_types", None)  # re-derived for the new count by the config class
    if vision is not None:
        vc = data["vision_config"]
        vc["depth" if "depth" in vc else "num_hidden_layers"] = vision
    if edit:
        edit(data)
    path = tmp_path / f"{name}-{text}-{vision}.json"
    path.write_text(json.dumps(data))
    return str(path)


def _gemma3_pattern(data):  # Gemma 3's sliding/global pattern, period 2 here (6 in the 4B)
    data["text_config"]["layer_types"] = ["sliding_attention", "full_attention"] * 6


def _gemma2_pattern(data):  # Gemma 2 alternates sliding and global attention
    data["layer_types"] = ["sliding_attention", "full_attention"] * 6


def _all_sparse(data):  # every Qwen3-MoE layer sparse (the preset has a dense one)
    data["mlp_only_layers"] = []


def _window_pattern(data):  # Qwen2.5-VL full attention every 2nd block (every 8th in the 7B)
    data["vision_config"]["fullatt_block_indexes"] = [1, 3, 5, 7, 9, 11]


FAMILIES = {  # id: (preset, text, vision, edit, seq_len, spec fields, fast path taken)
    "onevision": ("tiny-llava-onevision", 8, 8, None, 64, {}, True),
    "idefics3": ("tiny-idefics3", 8, 8, None, 128, {}, True),
    "mixtral-moe": ("tiny-mixtral", 8, None, None, 64, {"precision": "bf16"}, True),
    "phi3-generic": ("tiny-phi3", 8, None, None, 64, {"grad_ckpt": True}, True),
    "qwen3-moe-ckpt": ("tiny-qwen3-moe", 8, None, _all_sparse, 64,
                       {"precision": "bf16", "grad_ckpt": True}, True),
    "gemma3-period-2": ("tiny-gemma3", 12, 8, _gemma3_pattern, 64, {}, True),
    "gemma2-period-2": ("tiny-gemma2", 12, None, _gemma2_pattern, 64, {"attn": "eager"}, True),
    "qwen2-vl": ("tiny-qwen2-vl", 8, 8, None, 320, {}, True),
    "qwen2.5-vl": ("tiny-qwen2.5-vl", 8, 12, _window_pattern, 320, {}, True),
    "qwen2-vl-mb2": ("tiny-qwen2-vl", 8, 8, None, 320, {"micro_batch": 2}, True),
    "smolvlm": ("tiny-smolvlm", 8, 8, None, 128, {}, True),
    "internvl": ("tiny-internvl", 8, 8, None, 128, {}, True),
    "mistral3": ("tiny-mistral3", 8, 8, None, 128, {"image_size": "112x84"}, True),
    # DeepStack taps vision layers by index: the repeat falls back to the full trace
    "qwen3-vl": ("tiny-qwen3-vl", 8, 8, None, 320, {"image_size": "256x288"}, False),
}
SLOW_FAMILIES = ("idefics3", "qwen3-moe-ckpt", "gemma3-period-2", "gemma2-period-2",
                 "qwen2-vl", "qwen2.5-vl",
                 "qwen2-vl-mb2", "smolvlm", "mistral3", "qwen3-vl")


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_FAMILIES
                                  else c for c in FAMILIES])
def test_families_fast_path_equals_full_trace(case, tmp_path, monkeypatch):
    """Every family the fast path serves gives the full trace's numbers (where the repeated
    pattern does not reproduce the longer trace the check sends a case to the full trace, with
    the reason in the notes: `taken` False)."""
    preset, text, vision, edit, seq, fields, taken = FAMILIES[case]
    fields = {"micro_batch": 1, **fields}
    spec = TrainingSpec(model=_family_config(tmp_path, preset, text, vision, edit),
                        seq_len=seq, **fields)
    full, fast = _both(spec, monkeypatch)
    assert _fast_taken(fast) == taken, fast.notes
    if not taken:
        assert any("every layer traced (" in n for n in fast.notes), fast.notes
    _same(full, fast)


def test_periodic_layer_lists_set_the_period(tmp_path):
    """A per-layer config list repeats with its period (Gemma 3's 5 sliding : 1 global makes
    6); the short config keeps the values of the layers it stands for."""
    import transformers

    text = transformers.Gemma3TextConfig(num_hidden_layers=40)  # sliding_window_pattern 6
    (stack,) = repeat.plan(TrainingSpec(model="tiny-llama"), text)
    assert stack.period == 6 and (stack.full - stack.traced) % 6 == 0
    short = repeat.shortened(text, [stack])
    full_types = text.layer_types
    assert short.layer_types == [full_types[i if i < stack.start + 6 else i + 40 - stack.traced]
                                 for i in range(stack.traced)]
    assert short.layer_types[5] == "full_attention"  # layer 5 is global in the full model
