"""Gemma 3's vision side as layers: the SigLIP tower and `Gemma3MultiModalProjector`, after
transformers 5.24 `modeling_gemma3.py` / `modeling_siglip.py`.

Why its own module: Gemma 3 reads the tower's `last_hidden_state` (after `post_layernorm`,
unlike LLaVA's hidden state) and its projector is no MLP: the (T, E) patch features are
average-pooled on the patch grid to `mm_tokens_per_image` soft tokens
(`nn.AvgPool2d(kernel = patches_per_side // tokens_per_side)`), normalised by a Gemma RMSNorm
(`weight` zeros, scale `1 + weight`) and multiplied by `mm_input_projection_weight` (E x LM
hidden, no bias). Every image is one crop at `vision_config.image_size` (896 px: 64 x 64
patches -> 16 x 16 = 256 tokens; `hybridmem.job.images`).

The language model (`gemma3_text`) has no closed form here yet (another branch adds Gemma 2/3
text decoders): `hybridmem.predict.trace_only_reason` sends Gemma 3 to the trace tier, and
`vision_modules` is the hook the analytic graph plugs in once that LM exists
(tests/test_vlm_families.py checks its parameters and activations against real models).
"""

from __future__ import annotations

from dataclasses import replace

from hybridmem.models.graph import Layer, Module, ParamTensor as T
from hybridmem.models.vision import vision_layers


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
