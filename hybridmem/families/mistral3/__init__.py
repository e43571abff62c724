"""Mistral-3 (docs/vlm-families.md): the Pixtral tower (2-D RoPE, native resolution, block-
diagonal attention over the images of a step), `Mistral3MultiModalProjector` (RMSNorm, patch
merger, Linear-GELU-Linear), a Mistral LM; the processor adds one [IMG_BREAK] / [IMG_END] per
row of image tokens (`ImagePlan.markers`). LLaVA with a Pixtral tower (pixtral-12b) shares the
tower, the rule and the pixel inputs (`families/common/pixtral/`).

This folder: the record and the presets (`presets/`; pixtral-12b is a LLaVA preset); the
tower, the rule, the graph and the closed forms are shared with LLaVA
(`families/common/pixtral/`).
"""

from __future__ import annotations

from hybridmem.families import VLM, Family
from hybridmem.families.common import pixtral


def check_config(data: dict) -> None:
    """A Pixtral tower and a decoder family's LM (Mistral3Config's defaults: pixtral, mistral)."""
    from hybridmem.families import DECODER, check_sub_config, types

    check_sub_config(data, "vision_config", ("pixtral",), "pixtral")
    check_sub_config(data, "text_config", types(DECODER), "mistral")


def light_config(data: dict):
    from hybridmem.models import light
    from hybridmem.families.common.pixtral.config import light_mistral3

    return light_mistral3(data, light.parse_text, light.parse_sub)


FAMILIES = (
    Family("mistral3", VLM, "modeling_mistral3.py", count_check=True, check_config=check_config,
           light_config=light_config, image_plan=pixtral.image_plan,
           hw_images=True, pixel_inputs=pixtral.pixel_inputs, vision_graph=pixtral.vision_graph,
           vision_seq=pixtral.vision_seq, meta_patches=pixtral.meta_patches,
           layer_kinds=pixtral.layer_kinds),
)
