"""Qwen-VL's image resize (`smart_resize`) and its processors' pixel ranges: the size the tower
sees, from which the image-token rule (`image_plan` in this folder's `__init__.py`) counts.

Restated here rather than imported: transformers' `image_processing_qwen2_vl` needs
torchvision, and the analytic tier imports no torch."""

from __future__ import annotations

import math

from hybridmem.errors import SpecError

# transformers image_processing_qwen2_vl.py `Qwen2VLImageProcessor.size` defaults:
# shortest_edge = 56 * 56 (min_pixels), longest_edge = 28 * 28 * 1280 (max_pixels)
QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 28 * 28 * 1280
# Qwen/Qwen3-VL-*-Instruct preprocessor_config.json (Qwen2VLImageProcessorFast, patch_size 16,
# merge_size 2): size = {"shortest_edge": 65536, "longest_edge": 16777216}
QWEN3_MIN_PIXELS = 65536
QWEN3_MAX_PIXELS = 16777216
# What the shipped presets' checkpoints declare (presets/NAME.preprocessor_config.json, the
# pixel keys of each checkpoint's preprocessor_config.json): Qwen/Qwen2.5-VL-*-Instruct
# min_pixels 3136, max_pixels 12845056 (= 4 .. 16384 merged 28 x 28 tokens; as quoted from the
# checkpoint by public processor code, e.g. a Rust port's tests "Trimmed from
# Qwen/Qwen2.5-VL-7B-Instruct"); Qwen/Qwen2-VL-*-Instruct the same range (its model card: "The
# default range for the number of visual tokens per image in the model is 4-16384"); Qwen3-VL
# size {"shortest_edge": 65536, "longest_edge": 16777216}, as above. The class defaults above
# apply to a config without one (the tiny presets, a config.json alone).


def pixel_range(cfg, qwen3: bool = False) -> tuple[int, int]:
    """(min_pixels, max_pixels) smart_resize keeps an image within: the checkpoint's processor
    limits where its config carries them (`models.loader.PREPROCESSOR_KEY`, from the
    preprocessor_config.json beside it), else the processor class's defaults."""
    given = getattr(cfg, "preprocessor_pixels", None)
    if given is None and isinstance(cfg, dict):
        given = cfg.get("preprocessor_pixels")
    if given:
        return int(given[0]), int(given[1])
    return (QWEN3_MIN_PIXELS, QWEN3_MAX_PIXELS) if qwen3 else (QWEN_MIN_PIXELS, QWEN_MAX_PIXELS)


QWEN_DEFAULT_SIZE = (448, 448)
"""Qwen2-VL has no native size; an assumed default (16 x 16 merged tokens = 256 per image)."""
QWEN_MAX_ASPECT = 200  # smart_resize: "absolute aspect ratio must be smaller than 200"


def smart_resize(height: int, width: int, factor: int, min_pixels: int = QWEN_MIN_PIXELS,
                 max_pixels: int = QWEN_MAX_PIXELS) -> tuple[int, int]:
    """transformers `image_processing_qwen2_vl.smart_resize`, restated (that module needs
    torchvision); tests/test_vlm_families.py checks it against the original."""
    if max(height, width) / min(height, width) > QWEN_MAX_ASPECT:
        raise SpecError("image_size", f"{height}x{width}",
                        reason=f"aspect ratio must be below {QWEN_MAX_ASPECT} (smart_resize)")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
