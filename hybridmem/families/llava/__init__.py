"""LLaVA, LLaVA-NeXT and LLaVA-OneVision (docs/vlm-families.md): a CLIP / SigLIP tower, a
Linear-act-Linear projector and a decoder family from `families/decoders/`. LLaVA also takes a
Pixtral tower (pixtral-12b): its rule, pixel inputs and graph are Mistral-3's (`mistral3.py`).

This folder: the image layout (CLS dropped under `default`, anyres tiles + base crop,
unpadding, one newline per row; OneVision's anyres_max_N downsampling) and the graph
(`model.py`), the CLIP / SigLIP towers (`vision.py`; also Gemma 3's and Idefics3's), the
config without transformers (`config.py`), the closed forms (`acts.py`), the presets
(`presets/`).
"""

from __future__ import annotations

from hybridmem.families import DECODER, VLM, Family, check_sub_config, mistral3

VISION_TYPES: tuple[str, ...] = ("clip_vision_model", "siglip_vision_model")
"""Vision towers with closed forms (`vision.py`)."""
PIXTRAL = "pixtral"
"""LLaVA (not -NeXT / -OneVision) also takes a Pixtral tower (pixtral-12b)."""


def _pixtral(cfg) -> bool:
    return getattr(getattr(cfg, "vision_config", None), "model_type", "") == PIXTRAL


def check_config(data: dict) -> None:
    """The vision tower and the LM must be families with closed forms."""
    kinds = VISION_TYPES + ((PIXTRAL,) if data.get("model_type") == "llava" else ())
    check_sub_config(data, "vision_config", kinds, "clip_vision_model")
    check_text_config(data)


def check_text_config(data: dict, default: str = "llama") -> None:
    """`text_config.model_type` (default `default`, the config class's) must be a decoder
    family with closed forms: the LM is priced by `families/decoders/`."""
    from hybridmem.families import types

    check_sub_config(data, "text_config", types(DECODER), default)


def image_plan(cfg, hw):
    from hybridmem.job.images import ImagePlan
    from hybridmem.families.llava.model import image_layout

    if _pixtral(cfg):
        return mistral3.image_plan(cfg, hw)
    side = None if hw is None else hw[0]
    layout = image_layout(cfg, side)
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
    if _pixtral(config):
        return mistral3.pixel_inputs(config, plan, n_images, dtype, device, host_shapes)
    import torch

    side = plan.size[0]
    return {"pixel_values": torch.zeros(n_images, 3, side, side, dtype=dtype, device=device)}


def vision_graph(cfg, spec, images, plan):
    from hybridmem.families.llava.model import vision_modules

    if _pixtral(cfg):
        return mistral3.vision_graph(cfg, spec, images, plan)
    return vision_modules(cfg, spec, images, plan)


def vision_seq(vc) -> int:
    """Tokens per crop of a CLIP / SigLIP tower (patches, + CLS for CLIP); 0 for Pixtral's
    packed sequence."""
    from hybridmem.families.llava.vision import tokens_per_crop

    return 0 if vc.model_type == PIXTRAL else tokens_per_crop(vc)


def light_config(data: dict):
    from hybridmem.families.llava.config import light_llava

    return light_llava(data)


def layer_kinds() -> dict:
    """CLIP / SigLIP towers and the projector (`acts.py`)."""
    from hybridmem.families.llava import acts as VA
    from hybridmem.families import LayerKind
    from hybridmem.families.common.activations import keeps_nothing

    from hybridmem.families.common.images import crop_pixel_bytes

    return {"vision_embeddings": LayerKind(VA.vision_embeddings, pixel_bytes=crop_pixel_bytes),
            "encoder_layer": LayerKind(VA.encoder_layer, checkpointed=True, linear=True),
            "layernorm": LayerKind(VA.layernorm), "projector": LayerKind(VA.projector, linear=True),
            "image_newline": LayerKind(keeps_nothing), "pooling_head": LayerKind(keeps_nothing)}


_COMMON = dict(check_config=check_config, image_plan=image_plan, vision_graph=vision_graph,
               vision_seq=vision_seq, layer_kinds=layer_kinds)
FAMILIES = (
    Family("llava", VLM, "modeling_llava.py", count_check=True,
           techniques=frozenset({"liger", "cce"}), hw_images=_pixtral, pixel_inputs=llava_pixels,
           light_config=light_config, meta_patches=mistral3.meta_patches, **_COMMON),
    Family("llava_next", VLM, "modeling_llava_next.py", count_check=True,
           pixel_inputs=anyres_pixels,
           light_config=light_config, **_COMMON),
    # configuration_llava_onevision.py: SigLIP so400m, "full" features of layer -1, 36
    # pinpoints by default: transformers' config class fills them
    Family("llava_onevision", VLM, "modeling_llava_onevision.py", count_check=True,
           full_config=True,
           pixel_inputs=anyres_pixels, **_COMMON),
)
