"""The Idefics3 / SmolVLM image processors' resize arithmetic, restated (no numpy, no PIL).

Why: the tile grid of a non-square image depends on the processors' exact rounding (the
second side is derived from the first side's rounded value and the aspect ratio), so
`plan.py` restates it rather than approximating it with two independent ceilings.
transformers 5.24 `image_processing_smolvlm.py` (`image_processing_idefics3.py` is the same):
`get_resize_output_image_size` and `resize_for_vision_encoder`. tests/test_smolvlm.py checks
the grid against `SmolVLMImageProcessorPil`.
"""

from __future__ import annotations

import math

MAX_IMAGE_SIZE = 4096
"""image_processing_smolvlm.py `MAX_IMAGE_SIZE`: "4k resolution as absolute maximum"."""


def resized(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """`get_resize_output_image_size`: the longest edge to `longest_edge`, the other side by the
    aspect ratio (int, then up to even: `_resize_output_size_rescale_to_max_len`), then both
    below MAX_IMAGE_SIZE (`_resize_output_size_scale_below_upper_bound`)."""
    aspect = width / height
    if width >= height:
        width, height = longest_edge, int(longest_edge / aspect)
        height += height % 2
    else:
        height, width = longest_edge, int(longest_edge * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def tile_grid(height: int, width: int, tile: int) -> tuple[int, int]:
    """(rows, cols) of `resize_for_vision_encoder`: the longer side up to whole tiles, the other
    from it by the aspect ratio, then up to whole tiles."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height // tile, width // tile
