"""The LLaVA architecture: a CLIP / SigLIP tower (or Pixtral's), a Linear-act-Linear projector
and a decoder family's LM, with LLaVA-1.5's single crop, LLaVA-NeXT's anyres tiles and
OneVision's anyres_max_N downsampling. The records of LLaVA, LLaVA-NeXT, LLaVA-OneVision and
LLaVA-NeXT-Video point at these hooks (docs/vlm-families.md).

This package: the image layout (CLS dropped under `default`, anyres tiles + base crop,
unpadding, one newline per row) and the graph (`graph.py`), the config without transformers
(`config.py`); the towers' graph and closed forms are `common/clip_siglip*.py` and
`common/pixtral/`.
"""

from __future__ import annotations

from hybridmem.families import check_sub_config, check_text_config
from hybridmem.families.common import pixtral
from hybridmem.families.common.llava_arch.styles import ANYRES, ONEVISION, SINGLE  # noqa: F401

VISION_TYPES: tuple[str, ...] = ("clip_vision_model", "siglip_vision_model")
"""Vision towers with closed forms (`families/common/clip_siglip.py`)."""
PIXTRAL = "pixtral"
"""LLaVA (not -NeXT / -OneVision) also takes a Pixtral tower (pixtral-12b)."""


def pixtral_tower(cfg) -> bool:
    """Whether its vision tower is Pixtral (`Family.hw_images` of LLaVA)."""
    return getattr(getattr(cfg, "vision_config", None), "model_type", "") == PIXTRAL


def check_config(data: dict, towers: tuple[str, ...] = VISION_TYPES) -> None:
    """The vision tower (one of `towers`) and the LM must be families with closed forms."""
    check_sub_config(data, "vision_config", towers, "clip_vision_model")
    check_text_config(data)


def image_plan(cfg, hw, style: str = SINGLE):
    from hybridmem.job.images import ImagePlan
    from hybridmem.families.common.llava_arch.graph import image_layout

    if pixtral_tower(cfg):
        return pixtral.image_plan(cfg, hw)
    side = None if hw is None else hw[0]
    layout = image_layout(cfg, side, style)
    s = side or cfg.vision_config.image_size
    return ImagePlan(cfg.model_type, tokens=layout.tokens, size=(s, s), layout=layout)


def anyres_pixels(config, plan, n_images, dtype, device=None, host_shapes=False) -> dict:
    """LlavaNextImageProcessor: (images, crops, C, H, W) and `image_sizes` (a list under the
    trace: `families.common.images.pixel_inputs`)."""
    import torch

    native, side = config.vision_config.image_size, plan.size[0]
    return {"pixel_values": torch.zeros(n_images, plan.layout.crops, 3, native, native,
                                        dtype=dtype, device=device),
            "image_sizes": ([[side, side]] * n_images if host_shapes else
                            torch.tensor([[side, side]] * n_images, device=device))}


def llava_pixels(config, plan, n_images, dtype, device=None, host_shapes=False) -> dict:
    """One (n, 3, side, side) tensor; a Pixtral tower's `image_sizes` too."""
    if pixtral_tower(config):
        return pixtral.pixel_inputs(config, plan, n_images, dtype, device, host_shapes)
    import torch

    side = plan.size[0]
    return {"pixel_values": torch.zeros(n_images, 3, side, side, dtype=dtype, device=device)}


def vision_graph(cfg, spec, images, plan, style: str = SINGLE):
    from hybridmem.families.common.llava_arch.graph import vision_modules

    if pixtral_tower(cfg):
        return pixtral.vision_graph(cfg, spec, images, plan, llava=True)
    return vision_modules(cfg, spec, images, plan, style)


def vision_seq(vc) -> int:
    """Tokens per crop of a CLIP / SigLIP tower (patches, + CLS for CLIP); 0 for Pixtral's
    packed sequence."""
    from hybridmem.families.common.clip_siglip import tokens_per_crop

    return 0 if vc.model_type == PIXTRAL else tokens_per_crop(vc)


def light_config(data: dict, pinpoints: list | None = None):
    from hybridmem.families.common.llava_arch.config import light_llava

    return light_llava(data, pinpoints)


def layer_kinds() -> dict:
    """CLIP / SigLIP towers and the projector (`acts.py`)."""
    from hybridmem.families.common import clip_siglip_acts as VA
    from hybridmem.families import LayerKind
    from hybridmem.families.common.activations import keeps_nothing

    from hybridmem.families.common.images import crop_pixel_bytes

    from hybridmem.families.common import clip_siglip as V
    from hybridmem.families.common.llava_arch.graph import ImageNewlineDims, ProjectorDims

    return {"vision_embeddings": LayerKind(VA.vision_embeddings, pixel_bytes=crop_pixel_bytes,
                                           dims=V.VisionEmbeddingsDims),
            "encoder_layer": LayerKind(VA.encoder_layer, checkpointed=True, linear=True,
                                       dims=V.EncoderLayerDims),
            "layernorm": LayerKind(VA.layernorm, dims=V.TowerNormDims),
            "projector": LayerKind(VA.projector, linear=True, dims=ProjectorDims),
            "image_newline": LayerKind(keeps_nothing, dims=ImageNewlineDims),
            "pooling_head": LayerKind(keeps_nothing, dims=V.PoolingHeadDims)}
