"""Gemma 3 (docs/vlm-families.md): a SigLIP tower, `Gemma3MultiModalProjector` (pooling to
`mm_tokens_per_image` soft tokens), the gemma3_text LM (`families/decoders/`) whose masks, on a batch
with images, are built per layer (bidirectional over image tokens).

This folder: the graph and config (`model.py`), the closed forms (`acts.py`: the projector,
the per-layer image masks the gemma3_text decoder layer adds), the presets (`presets/`).
"""

from __future__ import annotations

from hybridmem.families import VLM, Family


def check_config(data: dict) -> None:
    """The sub-configs the closed forms price: a SigLIP tower and the Gemma 3 text LM."""
    from hybridmem.families import check_sub_config
    from hybridmem.families.gemma3.model import TEXT_TYPE, VISION_TYPE

    check_sub_config(data, "text_config", (TEXT_TYPE,), TEXT_TYPE)
    check_sub_config(data, "vision_config", (VISION_TYPE,), VISION_TYPE)


def light_config(data: dict):
    from hybridmem.families.gemma3.model import light_config as gemma3_config
    from hybridmem.families.common.llava_arch.config import vision_config
    from hybridmem.models import light

    return gemma3_config(data, vision_config, light.parse_text)


def image_plan(cfg, hw):
    """Every image is pooled to `mm_tokens_per_image` (256) soft tokens; the SigLIP tower sees
    its native size (the processor resizes to it)."""
    from hybridmem.errors import SpecError
    from hybridmem.job.images import ImagePlan

    native = cfg.vision_config.image_size
    if hw is not None and hw[0] != native:
        raise SpecError("image_size", hw[0], (native,),
                        reason="Gemma 3's SigLIP tower takes its native size (the processor "
                        "resizes every image to it)")
    return ImagePlan(cfg.model_type, tokens=int(cfg.mm_tokens_per_image), size=(native, native))


def text_extras(config, image_mask) -> dict:
    """processing_gemma3 returns `token_type_ids` (1 at image tokens) for training: Gemma3Model
    builds the bidirectional-over-images masks from it (`create_masks_for_vision_model`)."""
    return {"token_type_ids": image_mask}


def vision_graph(cfg, spec, images, plan):
    """One native-size crop per image, pooled tokens."""
    from hybridmem.families.gemma3 import model as gemma3
    from hybridmem.models.graph import ImageLayout

    modules = gemma3.vision_modules(cfg, spec.micro_batch * images, runs=images > 0)
    return modules, ImageLayout(crops=1, features_per_crop=0, tokens=plan.tokens)


def vision_seq(vc) -> int:
    from hybridmem.families.common.clip_siglip import tokens_per_crop

    return tokens_per_crop(vc)  # SigLIP's patches


def lm_graph(cfg, spec, lm, images: int, plan):
    from hybridmem.families.gemma3.model import image_masks

    return image_masks(lm, images * plan.tokens)


def layer_kinds() -> dict:
    from hybridmem.families.gemma3 import acts as GA
    from hybridmem.families.gemma3.model import Gemma3ProjectorDims
    from hybridmem.families import LayerKind

    return {"gemma3_projector": LayerKind(GA.mm_projector, dims=Gemma3ProjectorDims)}


FAMILIES = (
    Family("gemma3", VLM, "modeling_gemma3.py", count_check=True, check_config=check_config,
           light_config=light_config, image_plan=image_plan, text_extras=text_extras,
           vision_graph=vision_graph, vision_seq=vision_seq, lm_graph=lm_graph,
           layer_kinds=layer_kinds),
)
