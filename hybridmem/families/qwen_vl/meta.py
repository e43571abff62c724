"""Qwen-VL's data-dependent helpers on meta tensors (the trace tier's `Family.meta_patches`).

Why: transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL code reads `image_grid_thw` values in its
vision helpers (`.tolist()`, loops) and token values in its M-RoPE index; meta tensors have no
values. The patches answer those reads with the shapes a CUDA run of the trace's batch has.
"""

from __future__ import annotations

import contextlib

import torch

# Qwen2-VL / Qwen2.5-VL modules whose vision helpers read `image_grid_thw` values
# (transformers vision_utils.py: `.tolist()`, loops) and whose M-RoPE index reads token values
QWEN_VL_MODULES = ("transformers.models.qwen2_vl.modeling_qwen2_vl",
                   "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
                   "transformers.models.qwen3_vl.modeling_qwen3_vl",
                   "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe")


@contextlib.contextmanager
def grid_helpers_on_meta():
    """Run Qwen-VL's data-dependent helpers on meta tensors as a CUDA run would, shapes exact.

    The batch keeps `image_grid_thw` on the CPU (`Family.pixel_inputs(host_shapes=True)`),
    so `get_vision_attention_seqlens` (cu_seqlens, read by `.tolist()` in the per-image SDPA
    split) runs as is; the helpers whose outputs meet meta tensors are moved to meta
    (`get_vision_position_ids` -> (patches, 2) int64, `get_vision_window_index`'s
    window_index). `compute_3d_position_ids` (M-RoPE, `get_rope_index` reads token values)
    returns a (3, batch, seq) int64 meta tensor, the shape `get_rope_index` returns, and keeps
    its (batch, 1) `rope_deltas` on the model as the original does; the
    placeholder count check is a no-op (the batch has exactly the rule's image tokens).
    """
    import importlib

    saved = []

    def patch(obj, name, new):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, new)

    for mod_name in QWEN_VL_MODULES:
        mod = importlib.import_module(mod_name)
        pos = mod.get_vision_position_ids
        patch(mod, "get_vision_position_ids",
              lambda *a, _f=pos, **k: _f(*a, **k).to("meta"))
        if hasattr(mod, "get_vision_interpolation_indices_and_weights"):
            # Qwen3-VL's learned position grid resampling: (patches, 4) indices and weights
            interp = mod.get_vision_interpolation_indices_and_weights
            patch(mod, "get_vision_interpolation_indices_and_weights",
                  lambda *a, _f=interp, **k: tuple(x.to("meta") for x in _f(*a, **k)))
        if hasattr(mod, "get_vision_window_index"):
            win = mod.get_vision_window_index

            def window(*a, _f=win, **k):
                with torch.device("cpu"):  # its factories (arange, tensor) take no device
                    index, cu = _f(*a, **k)
                return index.to("meta"), cu
            patch(mod, "get_vision_window_index", window)
        if hasattr(mod, "torch_compilable_check"):  # 5.x; 4.x's check: trace.compat
            patch(mod, "torch_compilable_check", lambda *a, **k: None)
        for cls in vars(mod).values():
            if isinstance(cls, type) and "compute_3d_position_ids" in vars(cls):
                def positions(self, input_ids=None, inputs_embeds=None, image_grid_thw=None,
                              *a, **k):
                    if image_grid_thw is None:
                        return None  # a text-only batch: the model's own 1-D positions
                    b, s = inputs_embeds.shape[:2]
                    # get_rope_index also leaves `self.rope_deltas` (batch, 1) on the model
                    self.rope_deltas = torch.empty(b, 1, dtype=torch.long, device="meta")
                    return torch.empty(3, b, s, dtype=torch.long, device="meta")
                patch(cls, "compute_3d_position_ids", positions)
    from hybridmem.families.qwen_vl.deepstack import deepstack_rows_on_meta
    try:
        with deepstack_rows_on_meta():  # Qwen3-VL's DeepStack bool row masks
            yield
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)
