"""Model shapes for sweeps: vision towers and Llama decoders as HF config dicts (no downloads).

A sweep names a vision tower and a decoder; `compose` glues them into a LLaVA-1.5 config (or a
plain decoder when the vision tower is "none"). The numbers are transcribed from the public
`config.json` files named next to each entry; the scaled decoders keep Llama-2-7B's ratios
(head_dim 128, intermediate = 11008/4096 x hidden) so that shapes between them are realistic.
"""

from __future__ import annotations

import copy

from hybridmem.errors import SpecError

VISION_TOWERS: dict[str, dict] = {
    # openai/clip-vit-large-patch14-336 (LLaVA-1.5's tower)
    "clip-vit-l14-336": {"model_type": "clip_vision_model", "hidden_size": 1024,
                         "intermediate_size": 4096, "num_hidden_layers": 24,
                         "num_attention_heads": 16, "patch_size": 14, "image_size": 336,
                         "projection_dim": 768},
    # openai/clip-vit-base-patch16
    "clip-vit-b16-224": {"model_type": "clip_vision_model", "hidden_size": 768,
                         "intermediate_size": 3072, "num_hidden_layers": 12,
                         "num_attention_heads": 12, "patch_size": 16, "image_size": 224,
                         "projection_dim": 512},
    # google/siglip-so400m-patch14-384
    "siglip-so400m-14-384": {"model_type": "siglip_vision_model", "hidden_size": 1152,
                             "intermediate_size": 4304, "num_hidden_layers": 27,
                             "num_attention_heads": 16, "patch_size": 14, "image_size": 384},
    # google/siglip-base-patch16-224
    "siglip-b16-224": {"model_type": "siglip_vision_model", "hidden_size": 768,
                       "intermediate_size": 3072, "num_hidden_layers": 12,
                       "num_attention_heads": 12, "patch_size": 16, "image_size": 224},
    # hand-made, for tests: the tiny-llava preset's tower (25 patches of 6 px)
    "clip-tiny": {"model_type": "clip_vision_model", "hidden_size": 32,
                  "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                  "patch_size": 6, "image_size": 30, "projection_dim": 32},
}

LLAMA_VOCAB = 32064  # llava-hf/llava-1.5-7b-hf text vocab (32000 + <image> + pad, to 64)


def _llama(hidden: int, layers: int, intermediate: int, heads: int, vocab: int = LLAMA_VOCAB,
           max_pos: int = 4096) -> dict:
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": heads, "max_position_embeddings": max_pos,
            "rms_norm_eps": 1e-5, "vocab_size": vocab}


DECODERS: dict[str, dict] = {
    "llama-tiny": _llama(64, 2, 128, 4, vocab=128, max_pos=512),  # tiny-llava preset's LLM
    # scaled-down Llama-2 shapes: head_dim 128 (64 for h512), intermediate 2.6875 x hidden
    "llama-h512-l8": _llama(512, 8, 1376, 8),
    "llama-h1024-l12": _llama(1024, 12, 2752, 8),
    "llama-h2048-l16": _llama(2048, 16, 5504, 16),
    "llama-h3072-l24": _llama(3072, 24, 8256, 24),
    "llama-7b": _llama(4096, 32, 11008, 32),  # lmsys/vicuna-7b-v1.5 (LLaVA-1.5-7B's LLM)
    "llama-13b": _llama(5120, 40, 13824, 40),  # lmsys/vicuna-13b-v1.5 (LLaVA-1.5-13B's LLM)
}

GQA_GROUP = 4
"""Query heads per KV head when `gqa = true`: Llama-3-8B / Mistral-7B use 32 heads, 8 KV."""


def _lookup(table: dict[str, dict], custom: dict[str, dict], name: str, field: str) -> dict:
    if name in custom:
        return copy.deepcopy(custom[name])
    if name in table:
        return copy.deepcopy(table[name])
    raise SpecError(field, name, sorted(table) + sorted(custom))


def decoder_config(name: str, gqa: bool, custom: dict[str, dict] | None = None,
                   field: str = "decoder") -> dict:
    """Llama config dict for `name`; `gqa` divides the KV heads by `GQA_GROUP`."""
    cfg = _lookup(DECODERS, custom or {}, name, field)
    if gqa:
        heads = cfg["num_attention_heads"]
        if heads % GQA_GROUP:
            raise SpecError("gqa", True, reason=f"{name} has {heads} heads, not a multiple "
                            f"of {GQA_GROUP}")
        cfg["num_key_value_heads"] = heads // GQA_GROUP
    return cfg


def compose(vision_name: str, decoder_name: str, gqa: bool, image_size: int | None,
            custom_vision: dict | None = None, custom_decoder: dict | None = None,
            field: str = "vision") -> tuple[str, dict]:
    """(label, HF config dict) of a LLaVA-1.5-style model, or of the bare decoder."""
    text = decoder_config(decoder_name, gqa, custom_decoder, field.replace("vision", "decoder"))
    label = decoder_name + ("-gqa" if gqa else "")
    if vision_name == "none":
        return label, {**text, "tie_word_embeddings": False}
    vision = _lookup(VISION_TOWERS, custom_vision or {}, vision_name, field)
    if image_size:
        vision["image_size"] = image_size
    vocab = text["vocab_size"]
    cfg = {
        "model_type": "llava",
        "text_config": text,
        "vision_config": vision,
        # layout of llava-hf/llava-1.5-7b-hf: features from the second-to-last layer, 2-layer
        # GELU MLP projector; the image token is the last vocabulary id here (any id works)
        "image_token_index": vocab - 1,
        "pad_token_id": 0,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        # SigLIP has no CLS token, so LLaVA-OneVision keeps every feature ("full")
        "vision_feature_select_strategy": ("default" if vision["model_type"] == "clip_vision_model"
                                           else "full"),
        "tie_word_embeddings": False,
        "vocab_size": vocab,
    }
    return f"{vision_name}@{vision['image_size']}+{label}", cfg
