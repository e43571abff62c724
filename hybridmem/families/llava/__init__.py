"""LLaVA, LLaVA-NeXT and LLaVA-OneVision (docs/vlm-families.md): a CLIP / SigLIP tower, a
Linear-act-Linear projector and a decoder family's LM. LLaVA also takes a Pixtral tower
(pixtral-12b).

This folder: the records and the presets (`presets/`); the architecture (image layout, graph,
config without transformers, closed forms) is shared with LLaVA-NeXT-Video
(`families/common/llava_arch/`), the towers with Gemma 3, Idefics3 and InternVL
(`families/common/clip_siglip*.py`, `families/common/pixtral/`).
"""

from __future__ import annotations

from functools import partial

from hybridmem.families import VLM, Family
from hybridmem.families.common import llava_arch as arch, pixtral

# configuration_llava_next.py `LlavaNextConfig.image_grid_pinpoints` default
NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
# the module names of transformers' LLaVA models (modeling_llava.py `LlavaModel`,
# modeling_llava_next.py `image_newline`)
PARTS = (("multi_modal_projector", "multi_modal_projector"), ("image_newline", "image_newline"),
         ("vision_tower", "vision_tower"))


def _hooks(style: str) -> dict:
    """The LLaVA architecture's hooks for one image layout (`llava_arch.SINGLE`, ...)."""
    return dict(check_config=arch.check_config, image_plan=partial(arch.image_plan, style=style),
                vision_graph=partial(arch.vision_graph, style=style), vision_seq=arch.vision_seq,
                layer_kinds=arch.layer_kinds, count_check=True, parts=PARTS)


FAMILIES = (
    # Liger / CCE patch its LM (apply_liger_kernel_to_llava; axolotl's CCE `cce_forward`)
    Family("llava", VLM, "modeling_llava.py", techniques=frozenset({"liger", "cce"}),
           **dict(_hooks(arch.SINGLE),
                  # LLaVA (not -NeXT / -OneVision) also takes a Pixtral tower (pixtral-12b)
                  check_config=partial(arch.check_config,
                                       towers=(*arch.VISION_TYPES, arch.PIXTRAL))),
           hw_images=arch.pixtral_tower, pixel_inputs=arch.llava_pixels,
           light_config=arch.light_config, meta_patches=pixtral.meta_patches),
    Family("llava_next", VLM, "modeling_llava_next.py", pixel_inputs=arch.anyres_pixels,
           light_config=partial(arch.light_config, pinpoints=NEXT_PINPOINTS),
           **_hooks(arch.ANYRES)),
    # configuration_llava_onevision.py: SigLIP so400m, "full" features of layer -1, 36
    # pinpoints by default: transformers' config class fills them
    Family("llava_onevision", VLM, "modeling_llava_onevision.py", full_config=True,
           pixel_inputs=arch.anyres_pixels, **_hooks(arch.ONEVISION)),
)
