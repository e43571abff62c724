"""Idefics3 / SmolVLM's image-token rule: the processor's resize to its longest edge, the split
into vision-size tiles plus a global image, the pixel shuffle's tokens per tile
(`processing_idefics3` `image_seq_len`; the resize arithmetic restated in `split_resize.py`).
"""

from __future__ import annotations

from hybridmem.errors import SpecError
from hybridmem.families.idefics3.split_resize import resized, tile_grid
from hybridmem.job.images import ImagePlan

SPLIT_DEFAULT_TILES = 4
"""Idefics3ImageProcessor / SmolVLMImageProcessor `size = {"longest_edge": 4 * 364}` with
`max_image_size` 364 (the vision tile): without a recorded size, 4 x the tile."""


def split_default_side(vc) -> int:
    """The processor's resize side when `--image-size` is not given: the SmolVLM checkpoints
    record their processor's `size` / `max_image_size` in `vision_config` of config.json
    (SmolVLM-256M: 2048 / 512, SmolVLM2-2.2B: 1536 / 384, the presets' transcription);
    Idefics3-8B does not (the class default, 4 tiles)."""
    side = _longest_edge(vc, "size")
    return SPLIT_DEFAULT_TILES * vc.image_size if side is None else side


def _longest_edge(vc, key: str) -> int | None:
    value = getattr(vc, key, None)
    if value is None:
        return None
    edge = value.get("longest_edge") if isinstance(value, dict) else None
    if isinstance(edge, bool) or not isinstance(edge, int) or edge <= 0:
        raise SpecError(f"vision_config.{key}", value, reason='give {"longest_edge": <pixels>}')
    return edge


def split_plan(cfg, hw: tuple[int, int] | None) -> ImagePlan:
    """Idefics3-style splitting (`processing_idefics3` `image_seq_len`)."""
    vc = cfg.vision_config
    tile = vc.image_size
    crop = _longest_edge(vc, "max_image_size")
    if crop is not None and crop != tile:  # the processor's crops must be the tower's tiles
        raise SpecError("vision_config.max_image_size", crop, (tile,),
                        reason="crops of another size than vision_config.image_size")
    if hw is None:
        hw = (split_default_side(vc),) * 2
    # the processor's resize to its longest edge (the image size given: max(H, W)), then
    # resize_for_vision_encoder to whole tiles (`split_resize.py`)
    h, w = resized(*hw, longest_edge=max(hw))
    rows, cols = tile_grid(h, w, tile)
    crops = rows * cols + (1 if rows * cols > 1 else 0)  # + the global image
    per_tile = (tile // vc.patch_size) ** 2 // cfg.scale_factor ** 2
    return ImagePlan(cfg.model_type, tokens=crops * per_tile, size=(h, w),
                     grid=(0, crops, per_tile))
