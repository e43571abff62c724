"""Idefics3's vision side as layers (transformers 5.24 `modeling_idefics3.py`; SmolVLM's
`modeling_smolvlm.py` is a modular copy, priced by the same layers): the SigLIP-like
`Idefics3VisionTransformer` over every tile and the pixel-shuffle connector.

Why its own module: the processor splits each image into vision-size tiles plus a global
image (`hybridmem.job.images`), all encoded as crops; the tower has no CLS, no pooling head and
no `position_ids` buffer (positions are bucketised from the patch mask per forward), and the
model reads `last_hidden_state` (after `post_layernorm`). The connector's `pixel_shuffle`
folds every scale x scale patches into one token of width E·scale², then
`modality_projection.proj` (no bias) maps it to the LM hidden.
"""

from __future__ import annotations

from typing import TypedDict

from dataclasses import replace

from hybridmem.models.graph import Layer, Module, ParamTensor as T
from hybridmem.families.common.clip_siglip import tokens_per_crop, vision_layers



class PixelShuffleDims(TypedDict):
    """`n` crops of `t` tokens, `s2` of them shuffled into one, from `h` to the LM's `out`."""

    n: int
    t: int
    h: int
    s2: int
    out: int


def connector_layer(cfg, n_crops: int) -> Layer:
    vc, th, s2 = cfg.vision_config, cfg.text_config.hidden_size, cfg.scale_factor ** 2
    return Layer(name="connector", kind="pixel_shuffle_projector",
                 params=(T("modality_projection.proj.weight", (th, vc.hidden_size * s2)),),
                 dims=dict(n=n_crops, t=tokens_per_crop(vc), h=vc.hidden_size, s2=s2, out=th))


def vision_modules(cfg, n_crops: int, runs: bool = True) -> list[Module]:
    """`model.vision_model` and `model.connector` for `n_crops` tiles (+ global images)."""
    tower = []
    for layer in vision_layers(cfg.vision_config, -1, n_crops, post_norm_feeds=True):
        if layer.kind == "pooling_head":
            continue
        if layer.kind == "vision_embeddings":
            # `pixel_values[real_images_inds]` is a copy the patch conv saves (as LLaVA-NeXT's
            # crop concatenation); no position_ids buffer
            layer = replace(layer, buffers=(), dims={**layer.dims, "anyres": True})
        tower.append(replace(layer, runs=runs))
    return [Module(name="vision_tower", prefix="model.vision_model", layers=tuple(tower)),
            Module(name="multi_modal_projector", prefix="model.connector",
                   layers=(replace(connector_layer(cfg, n_crops), runs=runs),))]
