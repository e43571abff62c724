"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (docs/vlm-families.md): native dynamic resolution, a
packed vision sequence with 2-D rotary, a patch merger, a Qwen text model with M-RoPE;
Qwen3-VL adds learned position embeddings and DeepStack mergers feeding early LM layers, with
a dense or a mixture-of-experts Qwen3 LM.

This folder: the image size (`resize.py`), the graphs (`model.py`, Qwen3-VL's
`qwen3_model.py`; its config without transformers `qwen3_config.py`), the closed forms
(`acts.py`, `qwen3_acts.py`), the meta-trace helpers (`meta.py`, DeepStack's `deepstack.py`),
the presets (`presets/`).
"""

from __future__ import annotations

from functools import partial

from hybridmem.families import MOE, VLM, Family


def image_plan(cfg, hw, qwen3: bool = False):
    """smart_resize to multiples of patch x merge within the processor's pixel range;
    grid_thw = (1, H/p, W/p) (one temporal patch: the processor repeats the image to
    `temporal_patch_size` frames); the merger turns every merge² patches into one LM token."""
    from hybridmem.families.qwen_vl import resize as R
    from hybridmem.job.images import ImagePlan

    vc = cfg.vision_config
    p, m = vc.patch_size, vc.spatial_merge_size
    lo, hi = R.pixel_range(cfg, qwen3)
    h, w = R.smart_resize(*(hw or R.QWEN_DEFAULT_SIZE), factor=p * m, min_pixels=lo,
                          max_pixels=hi)
    grid = (1, h // p, w // p)
    return ImagePlan(cfg.model_type, tokens=grid[1] * grid[2] // (m * m), size=(h, w),
                       grid=grid, markers=len(WRAP))


def pixel_inputs(config, plan, n_images, dtype, device=None, host_shapes=False) -> dict:
    """Qwen2VLImageProcessor: flatten_patches -> (grid_t*grid_h*grid_w, C*T*P*P) and
    `image_grid_thw` (on the CPU under the trace: its values are read)."""
    import torch

    vc = config.vision_config
    row = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    return {"pixel_values": torch.zeros(n_images * plan.patches, row, dtype=dtype, device=device),
            "image_grid_thw": torch.tensor([list(plan.grid)] * n_images, dtype=torch.long,
                                           device="cpu" if host_shapes else device)}


WRAP = ("vision_start_token_id", "vision_end_token_id")
"""The chat template's `<|vision_start|><|image_pad|><|vision_end|>` per image (Qwen2-VL /
Qwen3-VL chat_template.json; processing_qwen3_vl.py reads both ids): text tokens that split
the images, so `get_rope_index` (modeling_qwen2_vl.py, one `itertools.groupby` run of
`mm_token_type_ids` per image grid) sees one run per image."""


def image_wrap(config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(vision_start,), (vision_end,) of the config (`WRAP`)."""
    start, end = (getattr(config, key) for key in WRAP)
    return (start,), (end,)


def text_extras(config, image_mask) -> dict:
    """processing_qwen2_vl `return_mm_token_type_ids = True`: 1 marks image tokens; the model
    needs it for its 3-D (M-RoPE) position ids."""
    return {"mm_token_type_ids": image_mask}


def vision_graph(cfg, spec, images, plan):
    from hybridmem.families.qwen_vl.model import modules

    return modules(cfg, spec, images, plan)


def vision_seq(vc) -> int:
    return 0  # a packed sequence of every image's patches, no fixed tokens per crop


def qwen3_light_config(data: dict):
    from hybridmem.families.qwen_vl.qwen3_config import light_qwen3_vl

    return light_qwen3_vl(data)


def qwen3_vision_graph(cfg, spec, images, plan):
    """`model.visual` and its mergers incl. DeepStack's."""
    from hybridmem.families.qwen_vl import qwen3_model as qwen3_vl
    from hybridmem.models.graph import ImageLayout

    return (qwen3_vl.vision_modules(cfg, spec.micro_batch, images, plan),
            ImageLayout(crops=0, features_per_crop=0, tokens=plan.tokens))


def qwen3_lm_graph(cfg, spec, lm, images, plan):
    from hybridmem.families.qwen_vl.qwen3_model import with_deepstack

    return with_deepstack(lm, cfg, spec.micro_batch, images, plan)


def meta_patches():
    from hybridmem.families.qwen_vl.meta import grid_helpers_on_meta

    return grid_helpers_on_meta()


def layer_kinds() -> dict:
    """The packed vision tower and mergers (`acts.py`, `qwen3_acts.py`)."""
    from hybridmem.families.qwen_vl import acts as QA, qwen3_acts as Q3
    from hybridmem.families import LayerKind

    from hybridmem.families.qwen_vl import model as M, qwen3_model as M3

    return {"qwen_patch_embed": LayerKind(QA.patch_embed, pixel_bytes=QA.pixel_bytes,
                                          packed=True, dims=M.QwenPatchEmbedDims),
            "qwen_vision_rotary": LayerKind(QA.vision_rotary, dims=M.QwenRotaryDims),
            "qwen_vision_block": LayerKind(QA.vision_block, checkpointed=True,
                                           dims=M.QwenVisionBlockDims),
            "patch_merger": LayerKind(QA.patch_merger, dims=M.PatchMergerDims),
            "qwen3_pos_embed": LayerKind(Q3.pos_embed, dims=M3.PosEmbedDims),
            "qwen3_merger": LayerKind(Q3.merger, dims=M3.Qwen3MergerDims),
            "deepstack_add": LayerKind(Q3.deepstack_add, dims=M3.DeepstackDims)}


# `model.visual.merger` is the projector, nested in the tower: matched before `visual`
_COMMON = dict(parts=(("merger", "multi_modal_projector"), ("visual", "vision_tower")),
               hw_images=True, pixel_inputs=pixel_inputs, text_extras=text_extras,
               image_wrap=image_wrap, vision_seq=vision_seq, meta_patches=meta_patches,
               layer_kinds=layer_kinds)
_QWEN2 = dict(_COMMON, full_config=True, image_plan=image_plan, vision_graph=vision_graph)
# Qwen3VLTextConfig / Qwen3VLMoeTextConfig defaults (configuration_qwen3_vl(_moe).py)
_QWEN3_TEXT = {
    "qwen3_vl_text": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                          head_dim=128, hidden_act="silu", attention_bias=False,
                          attention_dropout=0.0),
    "qwen3_vl_moe_text": dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                              num_hidden_layers=24, num_attention_heads=16,
                              num_key_value_heads=16, head_dim=None, hidden_act="silu",
                              attention_bias=False, attention_dropout=0.0,
                              decoder_sparse_step=1, moe_intermediate_size=1408,
                              num_experts_per_tok=4, num_experts=60, mlp_only_layers=None),
}
# Qwen3VLVisionModel.get_input_embeddings raises NotImplementedError: checkpointing's
# enable_input_require_grads hooks only the LM's embed_tokens, a frozen tower saves nothing
_QWEN3 = dict(_COMMON, light_config=qwen3_light_config, image_plan=partial(image_plan, qwen3=True),
              tower_input_grads=False,
              vision_graph=qwen3_vision_graph, lm_graph=qwen3_lm_graph)
FAMILIES = (
    Family("qwen2_vl", VLM, "modeling_qwen2_vl.py", count_check=True, **_QWEN2),
    Family("qwen2_5_vl", VLM, "modeling_qwen2_5_vl.py", count_check=True, **_QWEN2),
    Family("qwen3_vl", VLM, "modeling_qwen3_vl.py", count_check=True,
           sub_text_defaults={"qwen3_vl_text": _QWEN3_TEXT["qwen3_vl_text"]}, **_QWEN3),
    # its LM is a Qwen3-MoE (the MoE closed forms: full bf16 only, analytic/scope.py)
    Family("qwen3_vl_moe", VLM, "modeling_qwen3_vl_moe.py", count_check=True,
           traits=frozenset({MOE}),
           sub_text_defaults={"qwen3_vl_moe_text": _QWEN3_TEXT["qwen3_vl_moe_text"]}, **_QWEN3),
)
