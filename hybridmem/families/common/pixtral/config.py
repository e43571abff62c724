"""Mistral-3's config for the analytic graph without importing transformers.

Why its own module: `Mistral3Config` nests a Pixtral vision config and a Mistral text config
whose defaults differ from the classes' (`configuration_mistral3.py` `sub_configs_defaults`);
`hybridmem.models.light` calls `light_mistral3` so the analytic tier stays import-light.
"""

from __future__ import annotations

from types import SimpleNamespace

from hybridmem.errors import SpecError

# configuration_mistral3.py Mistral3Config field defaults
MISTRAL3_DEFAULTS = dict(image_token_index=10, projector_hidden_act="gelu",
                         vision_feature_layer=-1, multimodal_projector_bias=False,
                         spatial_merge_size=2, tie_word_embeddings=True)
# configuration_mistral3.py `sub_configs_defaults["text_config"]` (no text_config given)
TEXT_WHEN_MISSING = dict(model_type="mistral", head_dim=128, hidden_act="silu",
                         hidden_size=5120, intermediate_size=32768, num_attention_heads=32,
                         num_hidden_layers=40, num_key_value_heads=8, vocab_size=131072,
                         sliding_window=None)
# configuration_pixtral.py PixtralVisionConfig field defaults
PIXTRAL_DEFAULTS = dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096,
                        num_hidden_layers=24, num_attention_heads=16, num_channels=3,
                        image_size=1024, patch_size=16, hidden_act="gelu")
# configuration_mistral3.py `sub_configs_defaults["vision_config"]` (no vision_config given)
VISION_WHEN_MISSING = dict(intermediate_size=4096, hidden_size=1024, patch_size=14,
                           image_size=1540, num_hidden_layers=24, num_attention_heads=16,
                           hidden_act="gelu")


def light_mistral3(data: dict, text, sub) -> SimpleNamespace:
    """The fields the graph parser reads (`text` / `sub`: light.py's `parse_text` / `parse_sub`)."""
    cfg = SimpleNamespace(**{**MISTRAL3_DEFAULTS,
                             **{k: v for k, v in data.items() if not k.startswith("_")}})
    cfg.image_token_id = cfg.image_token_index  # Mistral3Config.attribute_map
    cfg.text_config = text(data.get("text_config") or dict(TEXT_WHEN_MISSING), "text_config.")
    vision = data.get("vision_config") or dict(VISION_WHEN_MISSING)
    vc = sub({**PIXTRAL_DEFAULTS, **vision, "model_type": "pixtral"}, PIXTRAL_DEFAULTS,
             "vision_config.")
    if vc.hidden_size % vc.num_attention_heads:
        raise SpecError("vision_config.hidden_size", vc.hidden_size,
                        reason=f"not a multiple of num_attention_heads={vc.num_attention_heads}")
    vc.head_dim = vc.hidden_size // vc.num_attention_heads  # PixtralVisionConfig.__post_init__
    if not isinstance(vc.image_size, int) or not isinstance(vc.patch_size, int):
        raise SpecError("vision_config.image_size", vc.image_size,
                        reason="give an int (square) image_size and patch_size")
    cfg.vision_config = vc
    return cfg
