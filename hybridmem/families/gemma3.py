"""Gemma 3 (docs/vlm-families.md): a SigLIP tower, `Gemma3MultiModalProjector` (pooling to
`mm_tokens_per_image` soft tokens), the gemma3_text LM. Priced by the trace tier: the tower and
projector closed forms exist (`models/gemma3.py`, `analytic/gemma3_acts.py`), the whole-model
analytic graph is not wired yet (`predict.trace_only_reason`).
"""

from __future__ import annotations

from hybridmem.families import VLM, Family


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


FAMILIES = (
    Family("gemma3", VLM, "modeling_gemma3.py", image_plan=image_plan,
           trace_only="the SigLIP tower and projector have closed forms "
           "(hybridmem/models/gemma3.py), the Gemma 3 text LM not yet",
           text_extras=text_extras),
)
