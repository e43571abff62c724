"""Qwen3-VL's vision side and DeepStack as layers, following transformers 5.24
`modeling_qwen3_vl.py` parameter by parameter.

Why its own module: Qwen3-VL keeps Qwen2-VL's packed patch sequence (attention per image,
`cu_seqlens`) but changes most parts around it, and adds DeepStack:

- `Qwen3VLVisionPatchEmbed`: Conv3d (C, T, P, P) -> hidden, *with* a bias;
- `pos_embed`: a learned (num_position_embeddings, hidden) table, bilinearly resampled to each
  image's grid (`vision_utils.get_vision_interpolation_indices_and_weights`: 4 taps per patch);
- `Qwen3VLVisionRotaryEmbedding`: inv_freq of head_dim/4 entries (2-D axial), two fp32 buffers;
- `Qwen3VLVisionBlock`: LayerNorm norm1/norm2 (weight + bias), `attn.qkv`, `attn.proj`,
  `mlp.linear_fc1` / `mlp.linear_fc2` (all biased), `hidden_act` gelu_pytorch_tanh;
- `Qwen3VLVisionPatchMerger` `merger`: LayerNorm(hidden), view to (n/m², hidden·m²),
  linear_fc1 (hidden·m² -> same) - GELU - linear_fc2 (-> out_hidden_size);
- `deepstack_merger_list.i`: the same merger with the norm after the shuffle
  (`use_postshuffle_norm=True`: LayerNorm(hidden·m²)) on the output of block
  `deepstack_visual_indexes[i]`; its features are added to the image-token rows of the output
  of LM layer i (`Qwen3VLTextModel._deepstack_process`), priced as a `deepstack_add` layer.

The mergers are `multi_modal_projector` (their names hold `merger`, `build.PART_FRAGMENTS`).
The LM is Qwen3's decoder (`families/common/decoder_graph.py`, q/k norm) at `model.language_model`.
"""

from __future__ import annotations

from typing import TypedDict

from dataclasses import replace

from hybridmem.job.images import ImagePlan
from hybridmem.models.graph import Layer, Module, ParamTensor as T, linear
from hybridmem.families.qwen_vl.model import norm_params



class PosEmbedDims(TypedDict):
    n: int
    h: int
    taps: int
    """The bilinear interpolation's taps per patch."""


class _MergerDims(TypedDict):
    n: int
    h: int
    m2: int
    out: int
    tokens: int
    postshuffle: bool


class Qwen3MergerDims(_MergerDims, total=False):
    block: int
    """A DeepStack merger's block index (the final merger has none)."""


class DeepstackDims(TypedDict):
    b: int
    s: int
    h: int
    rows: int
    """The image-token rows the visual features are added to."""


def _ln(prefix: str, e: int) -> tuple[T, ...]:
    """LayerNorm weight + bias (Qwen2-VL's helper, `rms=False`)."""
    return norm_params(prefix, e, rms=False)


FP32 = 4  # rotary inv_freq buffers are float32 (Qwen3VLVisionRotaryEmbedding)
# bilinear resampling: 4 table rows per patch (vision_utils
# get_vision_interpolation_indices_and_weights, `n_taps` = 4 for "bilinear")
TAPS = 4


def block_params(vc) -> tuple[T, ...]:
    e, f = vc.hidden_size, vc.intermediate_size
    return (_ln("norm1", e) + _ln("norm2", e) + linear("attn.qkv", 3 * e, e, True)
            + linear("attn.proj", e, e, True) + linear("mlp.linear_fc1", f, e, True)
            + linear("mlp.linear_fc2", e, f, True))


def merger_params(vc, postshuffle: bool) -> tuple[T, ...]:
    e, m2 = vc.hidden_size, vc.spatial_merge_size ** 2
    return (_ln("norm", e * m2 if postshuffle else e)
            + linear("linear_fc1", e * m2, e * m2, True)
            + linear("linear_fc2", vc.out_hidden_size, e * m2, True))


def vision_layers(vc, plan: ImagePlan, n_images: int) -> tuple[Layer, ...]:
    """`model.visual.*` minus the mergers, for `n_images` images of `plan`."""
    e, heads = vc.hidden_size, vc.num_heads
    n = n_images * plan.patches
    row = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    hd = e // heads
    rot = len(range(0, hd // 2, 2))  # compute_axial_rope_parameters: arange(0, dim // 2, 2)
    layers = [
        Layer(name="patch_embed", kind="qwen_patch_embed",
              params=(T("patch_embed.proj.weight", (e, vc.in_channels, vc.temporal_patch_size,
                                                     vc.patch_size, vc.patch_size)),
                      T("patch_embed.proj.bias", (e,))),
              dims=dict(n=n, row=row, h=e, images=n_images)),
        Layer(name="pos_embed", kind="qwen3_pos_embed",
              params=(T("pos_embed.weight", (vc.num_position_embeddings, e)),),
              dims=dict(n=n, h=e, taps=TAPS)),
        Layer(name="rotary_pos_emb", kind="qwen_vision_rotary",
              buffers=(T("rotary_pos_emb.inv_freq", (rot,), FP32),
                       T("rotary_pos_emb.original_inv_freq", (rot,), FP32)),
              dims=dict(n=n, head_dim=hd)),
    ]
    params = block_params(vc)
    for i in range(vc.depth):
        layers.append(Layer(
            name=f"blocks.{i}", kind="qwen_vision_block", params=params, scope=f"blocks.{i}",
            dims=dict(n=n, h=e, heads=heads, head_dim=hd, ffn=vc.intermediate_size,
                      act=vc.hidden_act, rms=False, segments=(plan.patches,) * n_images,
                      window=False)))
    return tuple(layers)


def merger_layers(vc, plan: ImagePlan, n_images: int) -> tuple[Layer, ...]:
    """The DeepStack mergers (in block order), then the final merger."""
    dims = dict(n=n_images * plan.patches, h=vc.hidden_size, m2=vc.spatial_merge_size ** 2,
                out=vc.out_hidden_size, tokens=n_images * plan.tokens)
    deep = tuple(
        Layer(name=f"deepstack_merger_list.{i}", kind="qwen3_merger",
              scope=f"deepstack_merger_list.{i}", params=merger_params(vc, True),
              dims=dict(dims, postshuffle=True, block=b))
        for i, b in enumerate(vc.deepstack_visual_indexes))
    return deep + (Layer(name="merger", kind="qwen3_merger", scope="merger",
                         params=merger_params(vc, False), dims=dict(dims, postshuffle=False)),)


def vision_modules(cfg, micro_batch: int, images: int, plan: ImagePlan) -> list[Module]:
    """`model.visual` (vision_tower) and its mergers (multi_modal_projector)."""
    n_images = micro_batch * images
    runs = images > 0
    vc = cfg.vision_config
    vision = tuple(replace(layer, runs=runs) for layer in vision_layers(vc, plan, n_images))
    mergers = tuple(replace(layer, runs=runs) for layer in merger_layers(vc, plan, n_images))
    return [Module(name="vision_tower", prefix="model.visual", layers=vision),
            Module(name="multi_modal_projector", prefix="model.visual", layers=mergers)]


def with_deepstack(lm: Module, cfg, micro_batch: int, images: int, plan: ImagePlan) -> Module:
    """The LM with a `deepstack_add` layer after each of the first len(deepstack) decoder
    layers (`Qwen3VLTextModel.forward`: `layer_idx in range(len(deepstack_visual_embeds))`)."""
    k = len(cfg.vision_config.deepstack_visual_indexes) if images else 0
    tc = cfg.text_config
    out = []
    for layer in lm.layers:
        out.append(layer)
        idx = int(layer.name.split(".")[1]) if layer.kind == "decoder_layer" else -1
        if 0 <= idx < k:
            out.append(Layer(name=f"deepstack.{idx}", kind="deepstack_add",
                             dims=dict(b=micro_batch, s=layer.dims["s"], h=tc.hidden_size,
                                       rows=micro_batch * images * plan.tokens)))
    return replace(lm, layers=tuple(out))
