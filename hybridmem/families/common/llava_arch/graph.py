"""LLaVA-1.5 and LLaVA-NeXT: how many crops the vision tower sees and how many image tokens
land in the language model's sequence.

Counting follows transformers 5.x `modeling_llava.py` (`get_image_features`: hidden state
`vision_feature_layer`, CLS dropped under the `default` strategy) and `modeling_llava_next.py`
(`image_size_to_num_patches`, `get_anyres_image_grid_shape`, `unpad_image`,
`pack_image_features`).
"""

from __future__ import annotations

from typing import TypedDict

from dataclasses import replace

from hybridmem.errors import SpecError
from hybridmem.families.common.llava_arch.styles import ANYRES, ONEVISION, SINGLE
from hybridmem.families.common.clip_siglip import (
    has_cls, patches_per_side, tokens_per_crop, vision_layers,
)
from hybridmem.models.graph import ImageLayout, Layer, Module, ParamTensor as T, linear



class ProjectorDims(TypedDict):
    """LLaVA's MLP projector over `n` crops of `t` features (`d_in` wide) into the LM's `h`."""

    n: int
    t: int
    d_in: int
    h: int
    act: str
    packed: int
    """AnyRes: the packed per-image features the model keeps (0: none)."""


class ImageNewlineDims(TypedDict):
    n: int
    """`image_newline` rows appended in the batch."""
    h: int


def features_per_crop(cfg) -> int:
    """Tokens the projector sees per crop: `default` drops the first token (`[:, 1:]`)."""
    t = tokens_per_crop(cfg.vision_config)
    return t - 1 if cfg.vision_feature_select_strategy == "default" else t


def num_feature_layers(cfg) -> int:
    return 1 if isinstance(cfg.vision_feature_layer, int) else len(cfg.vision_feature_layer)


def llava_layout(cfg, image_size: int) -> ImageLayout:
    """LLaVA-1.5: the tower takes its native size only (fixed position embeddings)."""
    native = cfg.vision_config.image_size
    if image_size != native:
        raise SpecError("image_size", image_size, [native],
                        reason=f"the {cfg.vision_config.model_type} tower has fixed position "
                        "embeddings for its native size")
    f = features_per_crop(cfg)
    return ImageLayout(crops=1, features_per_crop=f, tokens=f)


def select_best_resolution(size: tuple[int, int], pinpoints) -> tuple[int, int]:
    """Same rule as transformers `image_processing_utils.select_best_resolution`."""
    h0, w0 = size
    best, best_eff, best_waste = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / w0, h / h0)
        eff = min(int(w0 * scale) * int(h0 * scale), w0 * h0)
        waste = w * h - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (h, w), eff, waste
    return best


def unpadded_size(cur: tuple[int, int], original: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of the feature map after `unpad_image` removes the letterbox padding."""
    ch, cw = cur
    oh, ow = original
    if ow / oh > cw / ch:
        new_h = int(round(oh * (cw / ow), 7))
        pad = (ch - new_h) // 2
        return ch - 2 * pad, cw
    new_w = int(round(ow * (ch / oh), 7))
    pad = (cw - new_w) // 2
    return ch, cw - 2 * pad


def llava_next_layout(cfg, image_size: int) -> ImageLayout:
    """LLaVA-NeXT anyres: base crop + best-resolution tiles, unpadded, one newline per row."""
    vc = cfg.vision_config
    side = patches_per_side(vc, vc.image_size)
    f = features_per_crop(cfg)
    if f != side * side:
        raise SpecError("vision_feature_select_strategy", cfg.vision_feature_select_strategy,
                        ["default" if has_cls(vc) else "full"],
                        reason=f"anyres packing needs {side}x{side} features per crop, got {f}")
    bh, bw = select_best_resolution((image_size, image_size), cfg.image_grid_pinpoints)
    gh, gw = -(-bh // vc.image_size), -(-bw // vc.image_size)  # image_size_to_num_patches
    rows, cols = unpadded_size((gh * side, gw * side), (image_size, image_size))
    return ImageLayout(crops=gh * gw + 1, features_per_crop=f, tokens=f + rows * (cols + 1),
                       newlines=rows)


def anyres_max(cfg) -> int | None:
    """OneVision's `vision_aspect_ratio` "anyres_max_N": at most ~N crops' worth of tile features
    (`int(vision_aspect_ratio.strip("anyres_max_"))`, modeling_llava_onevision.py)."""
    ratio = getattr(cfg, "vision_aspect_ratio", None)
    if not ratio:
        return None
    if not ratio.startswith("anyres_max_") or not ratio[len("anyres_max_"):].isdigit():
        raise SpecError("vision_aspect_ratio", ratio, ("anyres_max_<N>",))
    return int(ratio[len("anyres_max_"):])


def onevision_layout(cfg, image_size: int) -> ImageLayout:
    """LLaVA-OneVision (`LlavaOnevisionModel.pack_image_features`): LLaVA-NeXT's anyres tiles,
    unpadded; if the unpadded grid exceeds 1.1 x sqrt(N) crops' worth (anyres_max_N), it is
    bilinearly downsampled to `int(rows // ratio) x int(cols // ratio)`; one newline per row;
    the base crop's features first. The processor counts the same
    (`processing_llava_onevision._get_unpadded_features`)."""
    import math

    vc = cfg.vision_config
    side = patches_per_side(vc, vc.image_size)
    nxt = llava_next_layout(cfg, image_size)
    rows, cols = nxt.newlines, (nxt.tokens - nxt.features_per_crop) // nxt.newlines - 1
    ratio = math.sqrt(rows * cols / (anyres_max(cfg) * side ** 2))
    if ratio > 1.1:
        rows, cols = int(rows // ratio), int(cols // ratio)
    return ImageLayout(crops=nxt.crops, features_per_crop=nxt.features_per_crop,
                       tokens=nxt.features_per_crop + rows * (cols + 1), newlines=rows)


LAYOUTS = {SINGLE: llava_layout, ANYRES: llava_next_layout, ONEVISION: onevision_layout}


def image_layout(cfg, image_size: int | None, style: str = SINGLE) -> ImageLayout:
    size = cfg.vision_config.image_size if image_size is None else image_size
    return LAYOUTS[style](cfg, size)


def vision_modules(cfg, spec, images: int, plan, style: str = SINGLE
                   ) -> tuple[list[Module], ImageLayout]:
    """LLaVA / LLaVA-NeXT / OneVision: `model.vision_tower` (CLIP or SigLIP up to the feature
    layer), `model.multi_modal_projector` (Linear-act-Linear; modeling_llava
    LlavaMultiModalProjector) and, with anyres, `model.image_newline`."""
    layout = plan.layout
    vc, th = cfg.vision_config, cfg.text_config.hidden_size
    n_crops = spec.micro_batch * images * layout.crops
    runs = images > 0
    anyres = style != SINGLE
    vision = tuple(replace(layer, runs=runs)
                   for layer in vision_layers(vc, cfg.vision_feature_layer, n_crops))
    if anyres:  # crops are concatenated into a new pixel tensor
        vision = (replace(vision[0], dims={**vision[0].dims, "anyres": True}),) + vision[1:]
    d_in = vc.hidden_size * num_feature_layers(cfg)
    bias = bool(getattr(cfg, "multimodal_projector_bias", True))
    proj = linear("linear_1", th, d_in, bias) + linear("linear_2", th, th, bias)
    projector = Layer(name="projector", kind="projector", params=proj, runs=runs,
                      dims=dict(n=n_crops, t=layout.features_per_crop, d_in=d_in, h=th,
                                act=cfg.projector_hidden_act,
                                packed=spec.micro_batch * images * layout.tokens if anyres else 0))
    modules = [Module(name="vision_tower", prefix="model.vision_tower", layers=vision),
               Module(name="multi_modal_projector", prefix="model.multi_modal_projector",
                      layers=(projector,))]
    if anyres:
        # modeling_llava_next.LlavaNextModel, LlavaOnevisionModel:
        modules.append(Module(name="image_newline", prefix="model", layers=(
            Layer(name="image_newline", kind="image_newline", params=(T("image_newline", (th,)),),
                  runs=runs, dims=dict(n=spec.micro_batch * images * layout.newlines, h=th)),)))
    return modules, layout
