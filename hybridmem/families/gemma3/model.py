"""Gemma 3's vision side as layers: the SigLIP tower and `Gemma3MultiModalProjector`, after
transformers 5.24 `modeling_gemma3.py` / `modeling_siglip.py`.

Why its own module: Gemma 3 reads the tower's `last_hidden_state` (after `post_layernorm`,
unlike LLaVA's hidden state) and its projector is no MLP: the (T, E) patch features are
average-pooled on the patch grid to `mm_tokens_per_image` soft tokens
(`nn.AvgPool2d(kernel = patches_per_side // tokens_per_side)`), normalised by a Gemma RMSNorm
(`weight` zeros, scale `1 + weight`) and multiplied by `mm_input_projection_weight` (E x LM
hidden, no bias). Every image is one crop at `vision_config.image_size` (896 px: 64 x 64
patches -> 16 x 16 = 256 tokens; `hybridmem.job.images`).

The language model is the `gemma3_text` decoder (`families/common/decoder_graph.py`) at
`model.language_model`, with one difference the VLM makes (`image_masks`): a training batch
with images carries `token_type_ids`, and `Gemma3Model.forward` then builds both attention
masks itself (`create_masks_for_vision_model`: full = OR(causal, bidirectional image blocks),
sliding = AND(window, that)); neither can be skipped for SDPA's `is_causal`, so every layer,
full and sliding, gets a (b, 1, s, s) bool mask (tests/test_vlm_families.py checks the graph
against the meta model and the analytic tier against the trace tier).
"""

from __future__ import annotations

from typing import TypedDict

from dataclasses import replace

from hybridmem.errors import SpecError
from hybridmem.models.graph import Layer, Module, ParamTensor as T
from hybridmem.families.common.clip_siglip import vision_layers

# configuration_gemma3.Gemma3Config class defaults (the fields the graph reads)
DEFAULTS = dict(mm_tokens_per_image=256, boi_token_index=255_999, eoi_token_index=256_000,
                image_token_index=262_144, tie_word_embeddings=True)
TEXT_TYPE = "gemma3_text"            # Gemma3Config.sub_configs_defaults["text_config"]
VISION_TYPE = "siglip_vision_model"  # Gemma3Config.sub_configs_defaults["vision_config"]



class Gemma3ProjectorDims(TypedDict):
    """`n` images of `t` patches pooled to `k` tokens, from the tower's `h` to the LM's `out`."""

    n: int
    t: int
    k: int
    h: int
    out: int


def light_config(data: dict, vision, text):
    """Gemma3Config's fields as attributes without transformers: `vision` / `text` are
    `models.light`'s sub-config readers (SiglipVisionConfig / Gemma3TextConfig defaults)."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(**{**DEFAULTS, **{k: v for k, v in data.items()
                                            if not k.startswith("_")}})
    cfg.vision_config = vision({"model_type": VISION_TYPE, **(data.get("vision_config") or {})})
    cfg.text_config = text({"model_type": TEXT_TYPE, **(data.get("text_config") or {})},
                           "text_config.")
    return cfg


def projector_layer(cfg, n_images: int) -> Layer:
    vc, th = cfg.vision_config, cfg.text_config.hidden_size
    patches = vc.image_size // vc.patch_size
    tokens = int(cfg.mm_tokens_per_image)
    return Layer(name="projector", kind="gemma3_projector",
                 params=(T("mm_input_projection_weight", (vc.hidden_size, th)),
                         T("mm_soft_emb_norm.weight", (vc.hidden_size,))),
                 dims=dict(n=n_images, t=patches * patches, k=tokens, h=vc.hidden_size,
                           out=th))


def vision_modules(cfg, n_images: int, runs: bool = True) -> list[Module]:
    """`model.vision_tower` (SigLIP, no pooling head: `vision_use_head` false in Gemma 3's
    configs) and `model.multi_modal_projector` for `n_images` images of one step."""
    vc = cfg.vision_config
    tower = tuple(replace(layer, runs=runs) for layer in
                  vision_layers(vc, -1, n_images, post_norm_feeds=True))
    proj = replace(projector_layer(cfg, n_images), runs=runs)
    return [Module(name="vision_tower", prefix="model.vision_tower", layers=tower),
            Module(name="multi_modal_projector", prefix="model.multi_modal_projector",
                   layers=(proj,))]


def image_masks(lm: Module, image_tokens: int) -> Module:
    """The language model as `Gemma3Model` runs it on a batch with images: both masks built
    (`create_masks_for_vision_model`), so every decoder layer is `masked` (SDPA gets a mask:
    transformers repeats k, v to all heads, `use_gqa_in_sdpa` needs none) and the rotary
    layer (where the text LM prices its shared mask) counts `mask_types` bool masks. Without
    images (`token_type_ids` absent) `create_masks_for_generate` builds the text LM's masks."""
    if not image_tokens:
        return lm
    layers = []
    for layer in lm.layers:
        if layer.kind in ("decoder_layer", "rotary"):
            layer = replace(layer, dims={**layer.dims, "masked": True, "image_masks": True})
        layers.append(layer)
    return replace(lm, layers=tuple(layers))
