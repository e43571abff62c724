"""Qwen2-VL and Qwen2.5-VL vision side as layers, following transformers 5.24
`modeling_qwen2_vl.py` / `modeling_qwen2_5_vl.py` parameter by parameter.

Why its own module: unlike CLIP/SigLIP crops, the tower runs one packed sequence of all the
patches of all images of the step (`cu_seqlens`: attention per image; Qwen2.5-VL: per window
of `window_size` px in all blocks but `fullatt_block_indexes`), so its layers are priced on
`n_patches` tokens with a list of attention segment lengths.

- `PatchEmbed`: Conv3d (C, temporal_patch_size, P, P) -> embed_dim, no bias;
- `VisionRotaryEmbedding`: inv_freq of head_dim/4 (2-D axial rope), two fp32 buffers;
- block: norm1, `attn.qkv` (3E x E, bias), `attn.proj` (bias), norm2, MLP. Qwen2-VL: LayerNorm
  (weight + bias), fc1/fc2 with `mlp_ratio`; Qwen2.5-VL: RMSNorm (weight), SwiGLU
  gate/up/down with biases, `intermediate_size`;
- `PatchMerger` (the projector, `model.visual.merger`): ln_q on embed_dim, then
  Linear(E·m², E·m²) - GELU - Linear(E·m², LM hidden) over every m x m patches.
"""

from __future__ import annotations

from typing import TypedDict

from hybridmem.job.images import ImagePlan
from hybridmem.models.graph import Layer, ParamTensor as T, linear

FP32 = 4  # rotary inv_freq buffers are float32 (Qwen2VLVisionRotaryEmbedding)



class QwenPatchEmbedDims(TypedDict):
    """The packed sequence of `n` patches, each a `row` of pixels, embedded to `h`."""

    n: int
    row: int
    h: int
    images: int


class QwenRotaryDims(TypedDict):
    n: int
    head_dim: int


class QwenVisionBlockDims(TypedDict):
    n: int
    h: int
    heads: int
    head_dim: int
    ffn: int
    act: str
    rms: bool
    segments: tuple
    """The attention segments' patch counts (whole images, or Qwen2.5-VL's windows)."""
    window: bool


class PatchMergerDims(TypedDict):
    n: int
    h: int
    m2: int
    out: int
    rms: bool
    tokens: int


def is_qwen25(vc) -> bool:
    return hasattr(vc, "fullatt_block_indexes")


def embed_dim(vc) -> int:
    """Width inside the tower (Qwen2-VL `embed_dim`; Qwen2.5-VL `hidden_size`)."""
    return vc.hidden_size if is_qwen25(vc) else vc.embed_dim


def out_dim(vc) -> int:
    """The merger's output width = the LM hidden (Qwen2-VL `hidden_size`; 2.5 `out_hidden_size`)."""
    return vc.out_hidden_size if is_qwen25(vc) else vc.hidden_size


def ffn_dim(vc) -> int:
    return vc.intermediate_size if is_qwen25(vc) else int(vc.embed_dim * vc.mlp_ratio)


def norm_params(prefix: str, e: int, rms: bool) -> tuple[T, ...]:
    return (T(f"{prefix}.weight", (e,)),) + (() if rms else (T(f"{prefix}.bias", (e,)),))


def block_params(vc) -> tuple[T, ...]:
    e, f, rms = embed_dim(vc), ffn_dim(vc), is_qwen25(vc)
    attn = linear("attn.qkv", 3 * e, e, True) + linear("attn.proj", e, e, True)
    if rms:  # Qwen2_5_VLMLP(bias=True): gate_proj, up_proj, down_proj
        mlp = (linear("mlp.gate_proj", f, e, True) + linear("mlp.up_proj", f, e, True)
               + linear("mlp.down_proj", e, f, True))
    else:  # VisionMlp: fc1, act, fc2
        mlp = linear("mlp.fc1", f, e, True) + linear("mlp.fc2", e, f, True)
    return norm_params("norm1", e, rms) + norm_params("norm2", e, rms) + attn + mlp


def window_segments(vc, plan: ImagePlan) -> tuple[int, ...]:
    """Patch counts of the attention windows of one image (Qwen2.5-VL
    `vision_utils.get_vision_window_index`: windows of `window_size // merge // patch` merged
    tokens a side, the grid padded up to whole windows, empty windows dropped)."""
    m = vc.spatial_merge_size
    win = vc.window_size // m // vc.patch_size
    gh, gw = plan.grid[1] // m, plan.grid[2] // m
    rows = [min(win, gh - i) for i in range(0, gh, win)]
    cols = [min(win, gw - j) for j in range(0, gw, win)]
    return tuple(r * c * m * m for r in rows for c in cols)


def vision_layers(vc, plan: ImagePlan, n_images: int) -> tuple[Layer, ...]:
    """The tower's layers (`model.visual.*` minus the merger) for `n_images` images."""
    e, heads, f = embed_dim(vc), vc.num_heads, ffn_dim(vc)
    n = n_images * plan.patches
    row = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    rot = (e // heads) // 4  # arange(0, head_dim // 2, 2)
    full = (plan.patches,) * n_images
    windows = window_segments(vc, plan) * n_images if is_qwen25(vc) else full
    layers = [
        Layer(name="patch_embed", kind="qwen_patch_embed",
              params=(T("patch_embed.proj.weight",
                        (e, vc.in_channels, vc.temporal_patch_size, vc.patch_size,
                         vc.patch_size)),),
              dims=dict(n=n, row=row, h=e, images=n_images)),
        Layer(name="rotary_pos_emb", kind="qwen_vision_rotary",
              buffers=(T("rotary_pos_emb.inv_freq", (rot,), FP32),
                       T("rotary_pos_emb.original_inv_freq", (rot,), FP32)),
              dims=dict(n=n, head_dim=e // heads)),
    ]
    params = block_params(vc)
    full_blocks = set(getattr(vc, "fullatt_block_indexes", range(vc.depth)))
    for i in range(vc.depth):
        layers.append(Layer(
            name=f"blocks.{i}", kind="qwen_vision_block", params=params, scope=f"blocks.{i}",
            dims=dict(n=n, h=e, heads=heads, head_dim=e // heads, ffn=f, act=vc.hidden_act,
                      rms=is_qwen25(vc), segments=full if i in full_blocks else windows,
                      window=is_qwen25(vc))))
    return tuple(layers)


def merger_layer(vc, plan: ImagePlan, n_images: int) -> Layer:
    e, m2 = embed_dim(vc), vc.spatial_merge_size ** 2
    rms = is_qwen25(vc)
    params = (norm_params("ln_q", e, rms) + linear("mlp.0", e * m2, e * m2, True)
              + linear("mlp.2", out_dim(vc), e * m2, True))
    return Layer(name="merger", kind="patch_merger", params=params,
                 dims=dict(n=n_images * plan.patches, h=e, m2=m2, out=out_dim(vc), rms=rms,
                           tokens=n_images * plan.tokens))


def modules(cfg, spec, images: int, plan: ImagePlan):
    """Qwen2-VL / Qwen2.5-VL: `model.visual` (patch embed, rotary, blocks) and its merger, and
    the LM-side layout (image tokens only: the tower sees no crops)."""
    from dataclasses import replace

    from hybridmem.models.graph import Module
    from hybridmem.models.graph import ImageLayout

    n_images = spec.micro_batch * images
    runs = images > 0
    vision = tuple(replace(layer, runs=runs)
                   for layer in vision_layers(cfg.vision_config, plan, n_images))
    merger = replace(merger_layer(cfg.vision_config, plan, n_images), runs=runs)
    return ([Module(name="vision_tower", prefix="model.visual", layers=vision),
             Module(name="multi_modal_projector", prefix="model.visual.merger", layers=(merger,))],
            ImageLayout(crops=0, features_per_crop=0, tokens=plan.tokens))
