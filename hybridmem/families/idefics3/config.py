"""The light config of the split-image families (Idefics3, SmolVLM) without transformers.

Why: the analytic tier prices a preset without importing torch or transformers (a ~4 s cold
start, more than the estimate of a SmolVLM-256M); these configs nest a vision and a Llama text
config whose few fields the graph reads have simple class defaults, restated here.
tests/test_models.py `test_every_preset_matches_the_meta_device_model` checks the graph built
from it against the model transformers builds from its own config class.
"""

from __future__ import annotations

from types import SimpleNamespace

from hybridmem.errors import SpecError

# configuration_idefics3.py `Idefics3VisionConfig` / configuration_smolvlm.py
# `SmolVLMVisionConfig` defaults (the same values)
SPLIT_VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12,
                             num_attention_heads=16, num_channels=3, image_size=224,
                             patch_size=32, hidden_act="gelu_pytorch_tanh")
# `Idefics3Config` / `SmolVLMConfig` defaults: scale_factor 2, image_token_id 128257, untied;
# the text config defaults to Llama (`sub_configs_defaults`: llama, rms_norm_eps 1e-5)
SPLIT_DEFAULTS = dict(scale_factor=2, image_token_id=128257, tie_word_embeddings=False)
VISION_TYPES = {"idefics3": "idefics3_vision", "smolvlm": "smolvlm_vision"}


def split_config(data: dict, text, sub) -> SimpleNamespace:
    """`data` (an idefics3 / smolvlm config dict) as attributes; `text` and `sub` are
    `models.light`'s text-config and sub-config readers (positive-field checks included)."""
    top = {k: v for k, v in data.items()
           if not k.startswith("_") and k not in ("vision_config", "text_config")}
    cfg = SimpleNamespace(**{**SPLIT_DEFAULTS, **top})
    vision = {**(data.get("vision_config") or {}), "model_type": VISION_TYPES[cfg.model_type]}
    vc = cfg.vision_config = sub(vision, SPLIT_VISION_DEFAULTS, "vision_config.")
    if vc.hidden_size % vc.num_attention_heads:  # the attention's head_dim (modeling_idefics3)
        raise SpecError("vision_config.hidden_size", vc.hidden_size,
                        reason=f"not a multiple of num_attention_heads={vc.num_attention_heads}")
    cfg.text_config = text({"model_type": "llama", **(data.get("text_config") or {})},
                           "text_config.")
    return cfg
