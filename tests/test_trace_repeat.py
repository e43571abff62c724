"""The trace tier's fast path (trace a few layers, repeat their pattern) equals the full trace.

The oracle is the full trace (`HYBRIDMEM_TRACE_FULL=1`), itself checked against real CPU runs
byte for byte in tests/test_trace.py and tests/test_generic.py. Tiny presets with their layer
counts raised (the fast path needs more layers than it traces: 6 + 7 per stack at period 1).
"""

from __future__ import annotations

import json

import pytest

from hybridmem.models.loader import load_config
from hybridmem.spec import TrainingSpec
from hybridmem.trace import estimate, repeat

PRESETS = "hybridmem/models/presets"


def _config(tmp_path, name: str, text: int, vision: int | None = None) -> str:
    with open(f"{PRESETS}/{name}.json") as f:
        data = json.load(f)
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
    # the memory savers (issue 12) on the fast path: each is a per-layer pattern too
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

    alternating = transformers.Qwen2Config(  # Gemma-2 / Qwen2 sliding-window style
        num_hidden_layers=12, layer_types=["sliding_attention", "full_attention"] * 6)
    with pytest.raises(repeat.NotRepeatable, match="layer_types differs"):
        repeat.plan(TrainingSpec(model="tiny-llama"), alternating)
    moe = transformers.MixtralConfig(num_hidden_layers=12)
    with pytest.raises(repeat.NotRepeatable, match="mixtral"):
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
