"""Mistral-3 (docs/vlm-families.md): the Pixtral tower (2-D RoPE, native resolution, block-
diagonal attention over the images of a step), `Mistral3MultiModalProjector` (RMSNorm, patch
merger, Linear-GELU-Linear), a Mistral LM; the processor adds one [IMG_BREAK] / [IMG_END] per
row of image tokens (`ImagePlan.markers`). LLaVA with a Pixtral tower (pixtral-12b) shares the
tower, the rule and the pixel inputs (`llava.py` dispatches here).

This folder: the rule and the graph (`model.py`), the config without transformers
(`config.py`), the closed forms (`acts.py`), the meta-trace helpers (`meta.py`), the presets
(`presets/`; pixtral-12b is a LLaVA preset).
"""

from __future__ import annotations

from hybridmem.families import VLM, Family


def check_config(data: dict) -> None:
    """A Pixtral tower and a decoder family's LM (Mistral3Config's defaults: pixtral, mistral)."""
    from hybridmem.families import DECODER, check_sub_config, types

    check_sub_config(data, "vision_config", ("pixtral",), "pixtral")
    check_sub_config(data, "text_config", types(DECODER), "mistral")


def light_config(data: dict):
    from hybridmem.models import light
    from hybridmem.families.mistral3.config import light_mistral3

    return light_mistral3(data, light._text, light._sub)


def image_plan(cfg, hw):
    from hybridmem.families.mistral3.model import pixtral_plan

    return pixtral_plan(cfg, hw)


def pixel_inputs(config, plan, n_images, dtype, device=None, host_shapes=False) -> dict:
    """PixtralImageProcessor: (images, C, H, W) padded to the largest (all images share the
    plan's size) and `image_sizes` (images, 2), whose values the tower reads per image."""
    import torch

    h, w = plan.size
    sizes = [[h, w]] * n_images
    return {"pixel_values": torch.zeros(n_images, 3, h, w, dtype=dtype, device=device),
            "image_sizes": sizes if host_shapes else torch.tensor(sizes, device=device)}


def vision_graph(cfg, spec, images, plan):
    """One packed patch sequence per step (Mistral-3, pixtral-12b)."""
    from hybridmem.families.mistral3 import model as mistral3
    from hybridmem.models.graph import ImageLayout

    modules = mistral3.vision_modules(cfg, plan, spec.micro_batch * images, runs=images > 0)
    return modules, ImageLayout(crops=0, features_per_crop=0, tokens=plan.tokens)


def vision_seq(vc) -> int:
    return 0  # a packed sequence of every image's patches, no fixed tokens per crop


def meta_patches():
    from hybridmem.families.mistral3.meta import sizes_on_meta

    return sizes_on_meta()


def layer_kinds() -> dict:
    """The Pixtral tower and Mistral-3's projector (`acts.py`)."""
    from hybridmem.families.mistral3 import acts as MA
    from hybridmem.families import LayerKind

    return {"pixtral_patch_conv": LayerKind(MA.patch_conv, pixel_bytes=MA.pixel_bytes,
                                            packed=True),
            "pixtral_ln_pre": LayerKind(MA.ln_pre),
            "pixtral_rotary": LayerKind(MA.rotary),
            "pixtral_block": LayerKind(MA.block, checkpointed=True, linear=True,
                                       sac_as=MA.as_decoder),
            "pixtral_projector": LayerKind(MA.projector, linear=True)}


FAMILIES = (
    Family("mistral3", VLM, "modeling_mistral3.py", count_check=True, check_config=check_config,
           light_config=light_config, image_plan=image_plan, hw_images=True,
           pixel_inputs=pixel_inputs, vision_graph=vision_graph, vision_seq=vision_seq,
           meta_patches=meta_patches, layer_kinds=layer_kinds),
)
