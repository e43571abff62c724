"""LLaVA-NeXT-Video (`llava_next_video`, transformers' `LlavaNextVideoForConditionalGeneration`;
docs/vlm-families.md): LLaVA-NeXT (a CLIP tower, anyres tiles + base crop, a Linear-GELU-Linear
projector, `image_newline`) fine-tuned on videos and images. Priced on image batches: its
image path is LLaVA-NeXT's (`get_image_features`, `pack_image_features` as in
modeling_llava_next.py); its `vision_resampler` (an `AvgPool2d`, no parameters) pools video
frames only. Video inputs are not priced.

This folder: the record and the presets (`presets/`); everything else is the shared LLaVA
architecture (`families/common/llava_arch/`) and the shared decoder LM.
"""

from __future__ import annotations

from functools import partial

from hybridmem.families import VLM, Family
from hybridmem.families.common import llava_arch as arch

# configuration_llava_next_video.py `LlavaNextVideoConfig.image_grid_pinpoints` default
# (transformers 5.24)
PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]

FAMILIES = (
    Family("llava_next_video", VLM, "modeling_llava_next_video.py",
           check_config=arch.check_config, light_config=partial(arch.light_config,
                                                                pinpoints=PINPOINTS),
           image_plan=partial(arch.image_plan, style=arch.ANYRES),
           vision_graph=partial(arch.vision_graph, style=arch.ANYRES),
           vision_seq=arch.vision_seq, pixel_inputs=arch.anyres_pixels,
           layer_kinds=arch.layer_kinds,
           # its `get_placeholder_mask` checks the image-token count (torch_compilable_check)
           count_check=True,
           # modeling_llava_next_video.py `LlavaNextVideoModel`: vision_tower,
           # multi_modal_projector, image_newline (vision_resampler holds no parameter)
           parts=(("multi_modal_projector", "multi_modal_projector"),
                  ("image_newline", "image_newline"), ("vision_tower", "vision_tower"))),
)
