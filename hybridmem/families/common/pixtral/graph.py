"""Mistral-3 (Mistral-Small-3.1) vision side as layers, after transformers 5.24
`modeling_mistral3.py` / `modeling_pixtral.py`, and its image-token rule.

Why its own module: the Pixtral tower has native dynamic resolution. Every image keeps its
(resized) size; the patch conv runs per padded image, the patches of all images of the step
are concatenated into ONE sequence (batch 1) with a block-diagonal additive mask
(`generate_block_attention_mask`: a dense (N, N) tensor in the stream dtype) and 2-D axial
RoPE. Blocks are Llama-like: RMSNorm, q/k/v/o without bias, SwiGLU. The projector
(`Mistral3MultiModalProjector`) is RMSNorm -> `Mistral3PatchMerger` (unfold of every
m x m patches, `merging_layer` E·m² -> E, no bias) -> linear_1 - GELU - linear_2.

The rule (`pixtral_plan`, read by `hybridmem.families.common.images.image_plan`): the processor
(`image_processing_pixtral.get_resize_output_image_size`) shrinks an image whose longer side
exceeds `longest_edge` (floor of each side / ratio), then rounds each side UP to a whole
number of merged patches (`patch_size * spatial_merge_size`, set by
`PixtralProcessor._process_images`); rows x cols [IMG] tokens, and the processor's
`replace_image_token` adds one [IMG_BREAK] per row, the last one [IMG_END] (text tokens).
"""

from __future__ import annotations

from typing import TypedDict

import math

from hybridmem.job.images import ImagePlan
from hybridmem.models.graph import Layer, Module, ParamTensor as T, linear

FP32 = 4  # PixtralVisionRotaryEmbedding inv_freq buffers are float32



class PackedDims(TypedDict):
    """The tower's one packed sequence of `n` patches, hidden `h`."""

    n: int
    h: int


class PatchConvDims(PackedDims):
    channels: int
    h_px: int
    w_px: int
    images: int


class PackedRotaryDims(TypedDict):
    n: int
    head_dim: int


class PixtralBlockDims(PackedDims):
    heads: int
    head_dim: int
    ffn: int


class PixtralProjectorDims(PackedDims):
    """Mistral-3's patch merger (`m2` patches into one) and MLP into the LM's `out`."""

    m2: int
    out: int
    tokens: int
    images: int


def longest_edge(cfg) -> int:
    """The processor's `size.longest_edge`: Mistral-Small-3.1's preprocessor_config sets it to
    the vision `image_size` (1540); an assumption for other checkpoints."""
    return cfg.vision_config.image_size


def pixtral_plan(cfg, hw: tuple[int, int] | None) -> ImagePlan:
    """Tokens per image at input size `hw` (default: a square image of `longest_edge`, the
    largest the processor passes on; every bigger image is shrunk to it)."""
    edge = longest_edge(cfg)
    # PixtralProcessor `patch_size * spatial_merge_size` (LLaVA-Pixtral: no merger, 1)
    p = cfg.vision_config.patch_size * getattr(cfg, "spatial_merge_size", 1)
    h, w = hw or (edge, edge)
    ratio = max(h / edge, w / edge)
    if ratio > 1:  # get_resize_output_image_size: floor, "always smaller than longest_edge"
        h, w = int(math.floor(h / ratio)), int(math.floor(w / ratio))
    rows, cols = (h - 1) // p + 1, (w - 1) // p + 1  # _num_image_tokens: ceil to patches
    return ImagePlan(cfg.model_type, tokens=rows * cols, size=(rows * p, cols * p),
                     markers=rows)


def patches(cfg, plan: ImagePlan) -> int:
    """Tower patches of one image (before the merger)."""
    p = cfg.vision_config.patch_size
    return (plan.size[0] // p) * (plan.size[1] // p)


def block_params(vc) -> tuple[T, ...]:
    """PixtralAttentionLayer: attention_norm, feed_forward (SwiGLU), attention, ffn_norm."""
    e, f = vc.hidden_size, vc.intermediate_size
    mlp = (linear("feed_forward.gate_proj", f, e, False) + linear("feed_forward.up_proj", f, e, False)
           + linear("feed_forward.down_proj", e, f, False))
    attn = sum((linear(f"attention.{n}", e, e, False)
                for n in ("k_proj", "v_proj", "q_proj", "o_proj")), ())
    return (T("attention_norm.weight", (e,)),) + mlp + attn + (T("ffn_norm.weight", (e,)),)


def vision_layers(cfg, plan: ImagePlan, n_images: int, runs: bool = True) -> tuple[Layer, ...]:
    """`model.vision_tower.*` for `n_images` images of `plan` (one packed sequence)."""
    vc = cfg.vision_config
    e, heads, f = vc.hidden_size, vc.num_attention_heads, vc.intermediate_size
    head_dim = e // heads  # PixtralVisionConfig.__post_init__ sets head_dim so
    n = n_images * patches(cfg, plan)
    side = dict(channels=vc.num_channels, h_px=plan.size[0], w_px=plan.size[1])
    layers = [
        Layer(name="patch_conv", kind="pixtral_patch_conv", runs=runs,
              params=(T("patch_conv.weight", (e, vc.num_channels, vc.patch_size,
                                              vc.patch_size)),),
              dims=dict(side, n=n, h=e, images=n_images)),
        Layer(name="ln_pre", kind="pixtral_ln_pre", runs=runs,
              params=(T("ln_pre.weight", (e,)),), dims=dict(n=n, h=e)),
        Layer(name="patch_positional_embedding", kind="pixtral_rotary", runs=runs,
              buffers=(T("patch_positional_embedding.inv_freq", (head_dim // 2,), FP32),
                       T("patch_positional_embedding.original_inv_freq", (head_dim // 2,),
                         FP32)),
              dims=dict(n=n, head_dim=head_dim)),
    ]
    params = block_params(vc)
    for i in range(vc.num_hidden_layers):
        layers.append(Layer(name=f"transformer.layers.{i}", kind="pixtral_block", runs=runs,
                            params=params, scope=f"transformer.layers.{i}",
                            dims=dict(n=n, h=e, heads=heads, head_dim=head_dim, ffn=f)))
    return tuple(layers)


def projector_layer(cfg, plan: ImagePlan, n_images: int, runs: bool = True) -> Layer:
    vc, th, m2 = cfg.vision_config, cfg.text_config.hidden_size, cfg.spatial_merge_size ** 2
    e = vc.hidden_size
    layers = cfg.vision_feature_layer
    d_in = e * (1 if isinstance(layers, int) else len(layers))
    bias = bool(cfg.multimodal_projector_bias)
    params = ((T("norm.weight", (e,)),) + linear("patch_merger.merging_layer", e, e * m2, False)
              + linear("linear_1", th, d_in, bias) + linear("linear_2", th, th, bias))
    return Layer(name="projector", kind="pixtral_projector", params=params, runs=runs,
                 dims=dict(n=n_images * patches(cfg, plan), h=e, m2=m2, out=th,
                           tokens=n_images * plan.tokens, images=n_images))


def llava_projector_layer(cfg, plan: ImagePlan, n_images: int, runs: bool = True) -> Layer:
    """LLaVA's `LlavaMultiModalProjector` over the tower's patches (pixtral-12b: no merger,
    one token per patch, "full" features): the `llava.acts.projector` formula."""
    e, th = cfg.vision_config.hidden_size, cfg.text_config.hidden_size
    bias = bool(getattr(cfg, "multimodal_projector_bias", True))
    return Layer(name="projector", kind="projector", runs=runs,
                 params=linear("linear_1", th, e, bias) + linear("linear_2", th, th, bias),
                 dims=dict(n=n_images, t=plan.tokens, d_in=e, h=th,
                           act=cfg.projector_hidden_act, packed=0))


def vision_modules(cfg, plan: ImagePlan, n_images: int, runs: bool = True,
                   llava: bool = False) -> list[Module]:
    """`model.vision_tower` and `model.multi_modal_projector` for `n_images` images: Mistral-3's
    projector, or LLaVA's (`llava`: the record of a LLaVA with this tower says so)."""
    proj = llava_projector_layer if llava else projector_layer
    return [Module(name="vision_tower", prefix="model.vision_tower",
                   layers=vision_layers(cfg, plan, n_images, runs)),
            Module(name="multi_modal_projector", prefix="model.multi_modal_projector",
                   layers=(proj(cfg, plan, n_images, runs),))]
