"""LLaVA / LLaVA-NeXT configs and CLIP / SigLIP vision configs for the graph parser, without
importing transformers (`models/light.py` reads the decoder part; `Family.light_config`).

The defaults are the transformers 5.x config classes' (`configuration_clip.py`,
`configuration_siglip.py`, `configuration_llava.py`, `configuration_llava_next.py`);
tests/test_models.py checks the result against models built from the real configs.
"""

from __future__ import annotations

from types import SimpleNamespace

from hybridmem.errors import SpecError
from hybridmem.models.light import parse_sub, parse_text

# defaults of the transformers 5.x config classes, for the fields the parser reads
VISION_DEFAULTS: dict[str, dict] = {
    "clip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                              num_attention_heads=12, num_channels=3, image_size=224,
                              patch_size=32, hidden_act="quick_gelu"),
    "siglip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                num_attention_heads=12, num_channels=3, image_size=224,
                                patch_size=16, hidden_act="gelu_pytorch_tanh",
                                vision_use_head=True),
}
# LlavaConfig without a vision_config builds CLIP ViT-L/14-336 (configuration_llava.py)
LLAVA_VISION = dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
                    patch_size=14, image_size=336, num_hidden_layers=24, num_attention_heads=16,
                    hidden_act="quick_gelu")
MULTIMODAL_DEFAULTS = dict(vision_feature_layer=-2, vision_feature_select_strategy="default",
                           projector_hidden_act="gelu", multimodal_projector_bias=True,
                           tie_word_embeddings=False)


def vision_config(data: dict | None) -> SimpleNamespace:
    """A CLIP / SigLIP (or, in LLaVA, Pixtral) `vision_config` with its class's defaults."""
    if data is None:
        data = LLAVA_VISION
    kind = data.get("model_type", "clip_vision_model")
    if kind == "pixtral":  # LLaVA with a Pixtral tower (pixtral-12b; common/pixtral/config.py)
        from hybridmem.families.common.pixtral.config import PIXTRAL_DEFAULTS as defaults
    else:
        defaults = VISION_DEFAULTS[kind]
    vc = parse_sub({**data, "model_type": kind}, defaults, "vision_config.")
    if vc.hidden_size % vc.num_attention_heads:
        raise SpecError("vision_config.hidden_size", vc.hidden_size,
                        reason=f"not a multiple of num_attention_heads={vc.num_attention_heads}")
    return vc


def light_llava(data: dict, pinpoints: list | None = None) -> SimpleNamespace:
    """A LLaVA / LLaVA-NeXT config: the tower's, the LM's and the projector's fields;
    `pinpoints`: the config class's `image_grid_pinpoints` default (anyres models)."""
    cfg = SimpleNamespace(**{**MULTIMODAL_DEFAULTS,
                             **{k: v for k, v in data.items() if not k.startswith("_")}})
    cfg.vision_config = vision_config(data.get("vision_config"))
    cfg.text_config = parse_text(data.get("text_config") or {}, "text_config.")
    # configuration_llava.py: the tie flag was saved in text_config by older checkpoints
    if not cfg.tie_word_embeddings and cfg.text_config.tie_word_embeddings:
        cfg.tie_word_embeddings = True
    if pinpoints is not None and getattr(cfg, "image_grid_pinpoints", None) is None:
        cfg.image_grid_pinpoints = pinpoints
    if cfg.vision_feature_select_strategy not in ("default", "full"):
        raise SpecError("vision_feature_select_strategy", cfg.vision_feature_select_strategy,
                        ("default", "full"))
    return cfg
