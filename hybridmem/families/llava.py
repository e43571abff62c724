"""LLaVA, LLaVA-NeXT and LLaVA-OneVision (docs/vlm-families.md): a CLIP / SigLIP tower, a
Linear-act-Linear projector and a decoder family from `decoders.py`.

Rules: `models/llava.py` (image layout: CLS dropped under `default`, anyres tiles + base crop,
unpadding, one newline per row; OneVision's anyres_max_N downsampling); graph
`models/llava.vision_modules`; activations `analytic/vision_acts.py`.
"""

from __future__ import annotations

from hybridmem.families import VLM, Family

VISION_TYPES: tuple[str, ...] = ("clip_vision_model", "siglip_vision_model")
"""Vision towers with closed forms (`models/vision.py`)."""


def check_config(data: dict) -> None:
    """The vision tower and the LM must be families with closed forms."""
    from hybridmem.errors import SpecError

    sub = data.get("vision_config")
    if isinstance(sub, dict) and sub.get("model_type", "clip_vision_model") not in VISION_TYPES:
        raise SpecError("vision_config.model_type", sub.get("model_type"), VISION_TYPES)
    check_text_config(data)


def check_text_config(data: dict, default: str = "llama") -> None:
    """`text_config.model_type` (default `default`, the config class's) must be a decoder
    family with closed forms: the LM is priced by `decoders.py`."""
    from hybridmem.errors import SpecError
    from hybridmem.families import DECODER, types

    sub = data.get("text_config")
    if isinstance(sub, dict) and sub.get("model_type", default) not in types(DECODER):
        raise SpecError("text_config.model_type", sub.get("model_type"), types(DECODER))


def image_plan(cfg, hw):
    from hybridmem.job.images import ImagePlan
    from hybridmem.models.llava import image_layout

    side = None if hw is None else hw[0]
    layout = image_layout(cfg, side)
    s = side or cfg.vision_config.image_size
    return ImagePlan(cfg.model_type, tokens=layout.tokens, size=(s, s), layout=layout)


def anyres_pixels(config, plan, n_images, dtype, device=None, host_shapes=False) -> dict:
    """LlavaNextImageProcessor: (images, crops, C, H, W) and `image_sizes` (a list under the
    trace: `job.images.pixel_inputs`)."""
    import torch

    native, side = config.vision_config.image_size, plan.size[0]
    return {"pixel_values": torch.zeros(n_images, plan.layout.crops, 3, native, native,
                                        dtype=dtype, device=device),
            "image_sizes": ([[side, side]] * n_images if host_shapes else
                            torch.tensor([[side, side]] * n_images, device=device))}


def vision_graph(cfg, spec, images, plan):
    from hybridmem.models.llava import vision_modules

    return vision_modules(cfg, spec, images, plan)


_COMMON = dict(check_config=check_config, image_plan=image_plan, vision_graph=vision_graph)
FAMILIES = (
    Family("llava", VLM, "modeling_llava.py", **_COMMON),
    Family("llava_next", VLM, "modeling_llava_next.py", pixel_inputs=anyres_pixels, **_COMMON),
    # configuration_llava_onevision.py: SigLIP so400m, "full" features of layer -1, 36
    # pinpoints by default: transformers' config class fills them
    Family("llava_onevision", VLM, "modeling_llava_onevision.py", full_config=True,
           pixel_inputs=anyres_pixels, **_COMMON),
)
