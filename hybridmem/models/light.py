"""A config object for the graph parser without importing torch or transformers.

`transformers.AutoConfig` costs ~4 s of imports on a cold start; the analytic tier needs a
few dozen fields, so it reads the JSON itself and fills what is missing with the defaults of
the transformers 5.x config classes: here the decoder's (each decoder family's defaults in its
record, `hybridmem/families/decoders/`), a VLM's by its family's `light_config` hook (LLaVA's
in `families/common/llava_arch/config.py`). tests/test_models.py checks the result against
models built from the real transformers configs, presets and random configs.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

from hybridmem.errors import SpecError
from hybridmem.families import DECODER, VLM, family, types
from hybridmem.models.loader import analytic_refusal, is_analytic, load_config_dict, validate_types

TEXT_DEFAULTS: dict[str, dict] = {
    **{mt: dict(family(mt).text_defaults) for mt in types(DECODER)},
    **{sub: dict(d) for mt in types(VLM) for sub, d in family(mt).sub_text_defaults.items()}}
"""Per decoder family (`hybridmem/families/decoders/`) and per VLM text sub-config type
that is no family of its own (Qwen3-VL's `qwen3_vl_text`)."""
# families whose many nested defaults transformers' own config class fills (`Family.full_config`:
# OneVision, Qwen-VL, Idefics3)
FULL_CONFIG_TYPES = types(where=lambda f: f.full_config)
POSITIVE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "vocab_size", "image_size", "patch_size", "num_channels")


def _positive(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(field, value, reason="must be a positive integer")


def parse_sub(data: dict, defaults: dict, prefix: str) -> SimpleNamespace:
    cfg = dict(defaults)
    cfg.update({k: v for k, v in data.items() if not k.startswith("_")})
    for key in POSITIVE:
        if key in cfg:
            _positive(prefix + key, cfg[key])
    return SimpleNamespace(**cfg)


def parse_text(data: dict, prefix: str = "") -> SimpleNamespace:
    kind = data.get("model_type", "llama")
    tc = parse_sub({**data, "model_type": kind}, TEXT_DEFAULTS[kind], prefix)
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
        return parse_text(data)
    return fam.light_config(data)  # the family's own parser (hybridmem/families/<family>/)


@lru_cache(maxsize=64)
def _cached(text: str) -> SimpleNamespace:
    import json

    return config_from_dict(json.loads(text))


def light_config(model: str) -> tuple[str, SimpleNamespace]:
    """(display name, config) for a preset name or a config path; no transformers import."""
    import json

    name, data = load_config_dict(model)
    return name, _cached(json.dumps(data, sort_keys=True))
