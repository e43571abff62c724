"""Qwen3-VL / Qwen3-VL-MoE configs for the graph parser without importing transformers.

Why: the analytic tier stays free of torch and transformers (`models/light.py`); Qwen3-VL's
config nests a vision and a text sub-config whose few fields the graph reads are filled here
with the defaults of transformers 5.24 `configuration_qwen3_vl.py` (`Qwen3VLVisionConfig`,
`Qwen3VLTextConfig`, `Qwen3VLConfig`) and `configuration_qwen3_vl_moe.py`.
tests/test_qwen3_vl.py checks the graph built from it against the meta-device model.
"""

from __future__ import annotations

from types import SimpleNamespace

# Qwen3VLVisionConfig / Qwen3VLMoeVisionConfig (the same defaults)
VISION_DEFAULTS = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh",
                       intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584,
                       num_position_embeddings=2304, deepstack_visual_indexes=(8, 16, 24))
# Qwen3VLConfig / Qwen3VLMoeConfig top-level fields the graph reads
TOP_DEFAULTS = dict(image_token_id=151655, video_token_id=151656, tie_word_embeddings=False)
TEXT_TYPE = {"qwen3_vl": "qwen3_vl_text", "qwen3_vl_moe": "qwen3_vl_moe_text"}
"""The text sub-config's model_type per family (its `text_config` class)."""


def light_qwen3_vl(data: dict) -> SimpleNamespace:
    """The fields the graph parser reads, with transformers' defaults, as attributes."""
    from hybridmem.models.light import parse_sub, parse_text

    mt = data["model_type"]
    cfg = SimpleNamespace(**{**TOP_DEFAULTS, **{k: v for k, v in data.items()
                                                if not k.startswith("_")}})
    text = data.get("text_config") or {}
    cfg.text_config = parse_text({**text, "model_type": TEXT_TYPE[mt]}, "text_config.")
    vision = {k: v for k, v in (data.get("vision_config") or {}).items() if k != "model_type"}
    cfg.vision_config = parse_sub(vision, VISION_DEFAULTS, "vision_config.")
    cfg.vision_config.model_type = f"{mt}_vision"
    return cfg
