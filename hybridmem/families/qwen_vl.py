"""Qwen2-VL and Qwen2.5-VL (docs/vlm-families.md): native dynamic resolution, a packed vision
sequence with 2-D rotary, a patch merger, a Qwen2 text model with M-RoPE.

Rules: image size `job/images.smart_resize`; graph `models/qwen_vl.py`; activations
`analytic/qwen_vl_acts.py`; meta-trace helpers `trace/corrections.grid_helpers_on_meta`.
"""

from __future__ import annotations

from hybridmem.families import VLM, Family


def image_plan(cfg, hw):
    """smart_resize to multiples of patch x merge; grid_thw = (1, H/p, W/p) (one temporal
    patch: the processor repeats the image to `temporal_patch_size` frames); the merger turns
    every merge² patches into one LM token."""
    from hybridmem.job.images import QWEN_DEFAULT_SIZE, ImagePlan, smart_resize

    vc = cfg.vision_config
    p, m = vc.patch_size, vc.spatial_merge_size
    h, w = smart_resize(*(hw or QWEN_DEFAULT_SIZE), factor=p * m)
    grid = (1, h // p, w // p)
    return ImagePlan(cfg.model_type, tokens=grid[1] * grid[2] // (m * m), size=(h, w), grid=grid)


def pixel_inputs(config, plan, n_images, dtype, device=None, host_shapes=False) -> dict:
    """Qwen2VLImageProcessor: flatten_patches -> (grid_t*grid_h*grid_w, C*T*P*P) and
    `image_grid_thw` (on the CPU under the trace: its values are read)."""
    import torch

    vc = config.vision_config
    row = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    return {"pixel_values": torch.zeros(n_images * plan.patches, row, dtype=dtype, device=device),
            "image_grid_thw": torch.tensor([list(plan.grid)] * n_images, dtype=torch.long,
                                           device="cpu" if host_shapes else device)}


def text_extras(config, image_mask) -> dict:
    """processing_qwen2_vl `return_mm_token_type_ids = True`: 1 marks image tokens; the model
    needs it for its 3-D (M-RoPE) position ids."""
    return {"mm_token_type_ids": image_mask}


def vision_graph(cfg, spec, images, plan):
    from hybridmem.models.qwen_vl import modules

    return modules(cfg, spec, images, plan)


def meta_patches():
    from hybridmem.trace.corrections import grid_helpers_on_meta

    return grid_helpers_on_meta()


_COMMON = dict(full_config=True, image_plan=image_plan, hw_images=True,
               pixel_inputs=pixel_inputs, text_extras=text_extras, vision_graph=vision_graph,
               meta_patches=meta_patches)
FAMILIES = (
    Family("qwen2_vl", VLM, "modeling_qwen2_vl.py", **_COMMON),
    Family("qwen2_5_vl", VLM, "modeling_qwen2_5_vl.py", **_COMMON),
)
