"""Idefics3 and SmolVLM (docs/vlm-families.md): image splitting into vision-size tiles + a
global image, a SigLIP-like tower, the pixel-shuffle connector, a Llama text model at
`model.text_model`. SmolVLM's modeling and image processing are Idefics3's
(`modular_smolvlm.py`); SmolVLM-256M/500M are even published as `idefics3`.

This folder: the split-image rule (`plan.py`: tiles, tokens per tile; the processor's resize
in `split_resize.py`), the config (`config.py`, no transformers import), the graph
(`model.py`), the connector's closed form (`acts.py`; the tower is CLIP's encoder layer), the
meta-trace helpers (`meta.py`), the presets (`presets/`).
"""

from __future__ import annotations

from hybridmem.families import VLM, Family, check_text_config


def light_config(data: dict):
    from hybridmem.models import light
    from hybridmem.families.idefics3.config import split_config

    return split_config(data, light.parse_text, light.parse_sub)


def image_plan(cfg, hw):
    from hybridmem.families.idefics3.plan import split_plan

    return split_plan(cfg, hw)


def pixel_inputs(config, plan, n_images, dtype, device=None, host_shapes=False) -> dict:
    """Idefics3ImageProcessor: (images, tiles + global, C, tile, tile) and the bool
    pixel_attention_mask; ones, not zeros: the model drops all-zero (padding) images."""
    import torch

    tile = config.vision_config.image_size
    return {"pixel_values": torch.ones(n_images, plan.crops, 3, tile, tile, dtype=dtype,
                                       device=device),
            "pixel_attention_mask": torch.ones(n_images, plan.crops, tile, tile,
                                               dtype=torch.bool, device=device)}


def vision_graph(cfg, spec, images, plan):
    from hybridmem.families.idefics3 import model as idefics3
    from hybridmem.models.graph import ImageLayout

    modules = idefics3.vision_modules(cfg, spec.micro_batch * images * plan.crops,
                                      runs=images > 0)
    return modules, ImageLayout(crops=plan.crops, features_per_crop=0, tokens=plan.tokens)


def vision_seq(vc) -> int:
    from hybridmem.families.common.clip_siglip import tokens_per_crop

    return tokens_per_crop(vc)  # the SigLIP-like tower's patches per tile


def meta_patches():
    from hybridmem.families.idefics3.meta import split_images_on_meta

    return split_images_on_meta()


def layer_kinds() -> dict:
    from hybridmem.families import LayerKind
    from hybridmem.families.idefics3.acts import pixel_shuffle_projector
    from hybridmem.families.idefics3.model import PixelShuffleDims

    return {"pixel_shuffle_projector": LayerKind(pixel_shuffle_projector, dims=PixelShuffleDims)}


_COMMON = dict(check_config=check_text_config, light_config=light_config, image_plan=image_plan,
               hw_images=True, pixel_inputs=pixel_inputs, pixel_mask=True,
               vision_graph=vision_graph, vision_seq=vision_seq, lm_prefix="model.text_model",
               meta_patches=meta_patches, layer_kinds=layer_kinds,
               # `model.connector` (the pixel-shuffle projector), `model.vision_model`
               parts=(("connector", "multi_modal_projector"), ("vision_model", "vision_tower")))
FAMILIES = (
    Family("idefics3", VLM, "modeling_idefics3.py", **_COMMON),
    Family("smolvlm", VLM, "modeling_smolvlm.py", **_COMMON),
)
