"""InternVL (docs/vlm-families.md): the InternViT tower (layer scale, optional RMSNorm and q/k
norm), pixel shuffle by `downsample_ratio`, `InternVLMultiModalProjector` (LayerNorm, Linear,
GELU, Linear), a Qwen2 / Qwen3 LM; the processor tiles every image into 1-12 vision-size tiles
by aspect ratio plus a thumbnail (`GotOcr2ImageProcessor.crop_to_patches`), so `--image-size`
may be `HxW` (the input image; `hw_images`).

This folder: the tiling rule, the config (no transformers import) and the graph (`model.py`);
the closed forms (`acts.py`: CLIP's encoder layer plus layer scale, the final norm, the
projector); the presets (`presets/`).
"""

from __future__ import annotations

from hybridmem.families import VLM, Family, check_text_config


def light_config(data: dict):
    from hybridmem.families.internvl.model import light_config as internvl_config

    return internvl_config(data)


def image_plan(cfg, hw):
    from hybridmem.families.internvl.model import image_plan as internvl_plan

    return internvl_plan(cfg, hw)


def pixel_inputs(config, plan, n_images, dtype, device=None, host_shapes=False) -> dict:
    """InternVLProcessor: every image's tiles in one (tiles, C, tile, tile) tensor."""
    import torch

    from hybridmem.families.internvl.model import tile_side

    tile = tile_side(config.vision_config)
    return {"pixel_values": torch.zeros(n_images * plan.crops, 3, tile, tile, dtype=dtype,
                                        device=device)}


def vision_graph(cfg, spec, images, plan):
    """Tiles + thumbnail through the tower, pixel shuffle, the projector."""
    from hybridmem.families.internvl import model as internvl
    from hybridmem.models.graph import ImageLayout

    modules = internvl.vision_modules(cfg, spec.micro_batch * images * plan.crops,
                                      runs=images > 0)
    return modules, ImageLayout(crops=plan.crops, features_per_crop=0, tokens=plan.tokens)


def vision_seq(vc) -> int:
    from hybridmem.families.internvl.model import tokens_per_crop

    return tokens_per_crop(vc)


def layer_kinds() -> dict:
    """InternViT's layers (CLIP's with layer scale), its final norm and projector."""
    from hybridmem.families.internvl import acts as IA
    from hybridmem.families.internvl.model import InternVLProjectorDims
    from hybridmem.families.common.clip_siglip import EncoderLayerDims, TowerNormDims
    from hybridmem.families import LayerKind

    return {"internvl_encoder_layer": LayerKind(IA.encoder_layer, checkpointed=True, linear=True,
                                                dims=EncoderLayerDims),
            "internvl_final_norm": LayerKind(IA.final_norm, dims=TowerNormDims),
            "internvl_projector": LayerKind(IA.projector, linear=True,
                                            dims=InternVLProjectorDims)}


FAMILIES = (
    Family("internvl", VLM, "modeling_internvl.py", count_check=True,
           check_config=check_text_config,
           light_config=light_config, image_plan=image_plan, hw_images=True,
           pixel_inputs=pixel_inputs,
           vision_graph=vision_graph, vision_seq=vision_seq, layer_kinds=layer_kinds),
)
