"""A config object for the graph parser without importing torch or transformers.

`transformers.AutoConfig` costs ~4 s of imports on a cold start; the analytic tier needs a
few dozen fields, so it reads the JSON itself and fills what is missing with the defaults of
the transformers 5.x config classes (`configuration_clip.py`, `configuration_siglip.py`,
`configuration_llava.py`, `configuration_llava_next.py` here; each decoder family's in its
`hybridmem/families/decoders.py` record). tests/test_models.py checks the
result against models built from the real transformers configs, presets and random configs.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

from hybridmem.errors import SpecError
from hybridmem.families import DECODER, VLM, family, types
from hybridmem.models.loader import analytic_refusal, is_analytic, load_config_dict, validate_types

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
TEXT_DEFAULTS: dict[str, dict] = {
    **{mt: dict(family(mt).text_defaults) for mt in types(DECODER)},
    **{sub: dict(d) for mt in types(VLM) for sub, d in family(mt).sub_text_defaults.items()}}
"""Per decoder family (`hybridmem/families/decoders.py`) and per VLM text sub-config type
that is no family of its own (Qwen3-VL's `qwen3_vl_text`)."""
# LlavaConfig without a vision_config builds CLIP ViT-L/14-336 (configuration_llava.py)
LLAVA_VISION = dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
                    patch_size=14, image_size=336, num_hidden_layers=24, num_attention_heads=16,
                    hidden_act="quick_gelu")
MULTIMODAL_DEFAULTS = dict(vision_feature_layer=-2, vision_feature_select_strategy="default",
                           projector_hidden_act="gelu", multimodal_projector_bias=True,
                           tie_word_embeddings=False)
NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
# families whose many nested defaults transformers' own config class fills (`Family.full_config`:
# OneVision, Qwen-VL, Idefics3)
FULL_CONFIG_TYPES = types(where=lambda f: f.full_config)
POSITIVE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "vocab_size", "image_size", "patch_size", "num_channels")


def _positive(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(field, value, reason="must be a positive integer")


def _sub(data: dict, defaults: dict, prefix: str) -> SimpleNamespace:
    cfg = dict(defaults)
    cfg.update({k: v for k, v in data.items() if not k.startswith("_")})
    for key in POSITIVE:
        if key in cfg:
            _positive(prefix + key, cfg[key])
    return SimpleNamespace(**cfg)


def _text(data: dict, prefix: str = "") -> SimpleNamespace:
    kind = data.get("model_type", "llama")
    tc = _sub({**data, "model_type": kind}, TEXT_DEFAULTS[kind], prefix)
    if tc.num_key_value_heads is None:
        tc.num_key_value_heads = tc.num_attention_heads
    _positive(prefix + "num_key_value_heads", tc.num_key_value_heads)
    if tc.num_attention_heads % tc.num_key_value_heads:
        raise SpecError(prefix + "num_key_value_heads", tc.num_key_value_heads,
                        reason=f"must divide num_attention_heads={tc.num_attention_heads}")
    if getattr(tc, "head_dim", None) is None and tc.hidden_size % tc.num_attention_heads:
        raise SpecError(prefix + "hidden_size", tc.hidden_size,
                        reason=f"not a multiple of num_attention_heads={tc.num_attention_heads}")
    return tc


def _vision(data: dict | None) -> SimpleNamespace:
    if data is None:
        data = LLAVA_VISION
    kind = data.get("model_type", "clip_vision_model")
    if kind == "pixtral":  # LLaVA with a Pixtral tower (pixtral-12b; families/mistral3/config.py)
        from hybridmem.families.mistral3.config import PIXTRAL_DEFAULTS as defaults
    else:
        defaults = VISION_DEFAULTS[kind]
    vc = _sub({**data, "model_type": kind}, defaults, "vision_config.")
    if vc.hidden_size % vc.num_attention_heads:
        raise SpecError("vision_config.hidden_size", vc.hidden_size,
                        reason=f"not a multiple of num_attention_heads={vc.num_attention_heads}")
    return vc


def config_from_dict(data: dict) -> SimpleNamespace:
    """The fields the graph parser reads, with transformers' defaults, as attributes."""
    model_type = validate_types(data)
    if not is_analytic(model_type):  # a transformers family the trace tier alone prices
        raise analytic_refusal(model_type)
    if model_type in FULL_CONFIG_TYPES:
        # their configs nest a vision and a text sub-config with many defaults (and the
        # published config.json is flat): transformers' own config class reads them
        from hybridmem.models.loader import load_config_data
        return load_config_data(data)
    fam = family(model_type)
    if fam.kind == DECODER:
        return _text(data)
    if fam.light_config is not None:  # the family's own parser (hybridmem/families/)
        return fam.light_config(data)
    cfg = SimpleNamespace(**{**MULTIMODAL_DEFAULTS,
                             **{k: v for k, v in data.items() if not k.startswith("_")}})
    cfg.vision_config = _vision(data.get("vision_config"))
    cfg.text_config = _text(data.get("text_config") or {}, "text_config.")
    # configuration_llava.py: the tie flag was saved in text_config by older checkpoints
    if not cfg.tie_word_embeddings and cfg.text_config.tie_word_embeddings:
        cfg.tie_word_embeddings = True
    if model_type == "llava_next" and getattr(cfg, "image_grid_pinpoints", None) is None:
        cfg.image_grid_pinpoints = NEXT_PINPOINTS
    if cfg.vision_feature_select_strategy not in ("default", "full"):
        raise SpecError("vision_feature_select_strategy", cfg.vision_feature_select_strategy,
                        ("default", "full"))
    return cfg


@lru_cache(maxsize=64)
def _cached(text: str) -> SimpleNamespace:
    import json

    return config_from_dict(json.loads(text))


def light_config(model: str) -> tuple[str, SimpleNamespace]:
    """(display name, config) for a preset name or a config path; no transformers import."""
    import json

    name, data = load_config_dict(model)
    return name, _cached(json.dumps(data, sort_keys=True))
