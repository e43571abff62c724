"""The Pixtral vision tower (2-D RoPE, native resolution, block-diagonal attention over the
images of a step) with Mistral-3's projector (RMSNorm, patch merger, Linear-GELU-Linear): the
shared part of Mistral-3 and LLaVA with a Pixtral tower (pixtral-12b), whose records point
at these hooks (docs/vlm-families.md).

This package: the image-token rule and the graph (`graph.py`), the config without transformers
(`config.py`), the closed forms (`acts.py`), the meta-trace helpers (`meta.py`).
"""

from __future__ import annotations


def image_plan(cfg, hw):
    from hybridmem.families.common.pixtral.graph import pixtral_plan

    return pixtral_plan(cfg, hw)


def pixel_inputs(config, plan, n_images, dtype, device=None, host_shapes=False) -> dict:
    """PixtralImageProcessor: (images, C, H, W) padded to the largest (all images share the
    plan's size) and `image_sizes` (images, 2), whose values the tower reads per image."""
    import torch

    h, w = plan.size
    sizes = [[h, w]] * n_images
    return {"pixel_values": torch.zeros(n_images, 3, h, w, dtype=dtype, device=device),
            "image_sizes": sizes if host_shapes else torch.tensor(sizes, device=device)}


def vision_graph(cfg, spec, images, plan, llava: bool = False):
    """One packed patch sequence per step, then Mistral-3's projector (`llava`: LLaVA's,
    pixtral-12b)."""
    from hybridmem.families.common.pixtral import graph as mistral3
    from hybridmem.models.graph import ImageLayout

    modules = mistral3.vision_modules(cfg, plan, spec.micro_batch * images, runs=images > 0,
                                      llava=llava)
    return modules, ImageLayout(crops=0, features_per_crop=0, tokens=plan.tokens)


def vision_seq(vc) -> int:
    return 0  # a packed sequence of every image's patches, no fixed tokens per crop


def meta_patches():
    from hybridmem.families.common.pixtral.meta import sizes_on_meta

    return sizes_on_meta()


def layer_kinds() -> dict:
    """The Pixtral tower and Mistral-3's projector (`acts.py`)."""
    from hybridmem.families.common.pixtral import acts as MA
    from hybridmem.families import LayerKind

    from hybridmem.families.common.pixtral import graph as G

    return {"pixtral_patch_conv": LayerKind(MA.patch_conv, pixel_bytes=MA.pixel_bytes,
                                            packed=True, dims=G.PatchConvDims),
            "pixtral_ln_pre": LayerKind(MA.ln_pre, dims=G.PackedDims),
            "pixtral_rotary": LayerKind(MA.rotary, dims=G.PackedRotaryDims),
            "pixtral_block": LayerKind(MA.block, checkpointed=True, linear=True,
                                       sac_as=MA.as_decoder, dims=G.PixtralBlockDims),
            "pixtral_projector": LayerKind(MA.projector, linear=True,
                                           dims=G.PixtralProjectorDims)}
