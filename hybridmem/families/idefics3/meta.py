"""Idefics3 / SmolVLM's image path on meta tensors (the trace tier's `Family.meta_patches`).

Why: `get_image_features` drops all-zero padding images by boolean indexing and splits the
features by `.tolist()` counts, and the vision encoder's mask check reads a tensor's values;
meta tensors have none. The patches answer them with the shapes a CUDA run of the trace's
batch has.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

# Idefics3 / SmolVLM modules whose `get_image_features` drops all-zero padding images by boolean
# indexing and splits the features by `.tolist()` counts (data-dependent on meta)
SPLIT_IMAGE_MODULES = ("transformers.models.idefics3.modeling_idefics3",
                       "transformers.models.smolvlm.modeling_smolvlm")


class _AllImagesReal(TorchFunctionMode):
    """`x[real_images_inds]` with a bool row index on meta -> a copy of every row (the index
    op's new tensor: the batch has no padding images, `Family.pixel_inputs`);
    `.tolist()` of the per-sample real-image counts -> `images` each."""

    def __init__(self, images: int):
        super().__init__()
        self.images = images

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and len(args) == 2:
            x, idx = args
            if (isinstance(idx, torch.Tensor) and idx.dtype == torch.bool and idx.is_meta
                    and idx.dim() == 1 and idx.shape[0] == x.shape[0]):
                return x.clone()
        if func is torch.Tensor.tolist and args[0].is_meta and args[0].dim() == 1:
            return [self.images] * args[0].shape[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def split_images_on_meta():
    """Run Idefics3's image path on meta tensors with the shapes a CUDA run has:
    every image of the batch is real (the one rule's pixel inputs are ones, never a padding
    image), so the boolean selection keeps all rows (as a copy) and each sample keeps its
    images; the placeholder count check is a no-op (the batch has the rule's image tokens)."""
    import functools
    import importlib

    saved = []
    for mod_name in SPLIT_IMAGE_MODULES:
        mod = importlib.import_module(mod_name)
        for cls in vars(mod).values():
            # the base model's own method (the ForConditionalGeneration one delegates):
            # it merges too (Idefics3 `inputs_merger`, SmolVLM `get_placeholder_mask`)
            if isinstance(cls, type) and "get_image_features" in vars(cls) and \
                    ("inputs_merger" in vars(cls) or "get_placeholder_mask" in vars(cls)):
                orig = cls.get_image_features

                @functools.wraps(orig)
                def features(self, pixel_values, *a, _f=orig, **k):
                    with _AllImagesReal(pixel_values.shape[1]):
                        return _f(self, pixel_values, *a, **k)
                saved.append((cls, "get_image_features", orig))
                cls.get_image_features = features
        if hasattr(mod, "torch_compilable_check"):
            saved.append((mod, "torch_compilable_check", mod.torch_compilable_check))
            mod.torch_compilable_check = lambda *a, **k: None
    # the vision encoder's `create_bidirectional_mask` skips the mask when the patch mask is
    # all True (`_ignore_bidirectional_mask_sdpa`: `padding_mask.all()`), as it is for whole
    # tiles: answer that without reading a meta tensor's values
    from transformers import masking_utils

    skip = masking_utils._ignore_bidirectional_mask_sdpa

    def ignore(padding_mask, *a, _f=skip, **k):
        meta = isinstance(padding_mask, torch.Tensor) and padding_mask.is_meta
        return _f(None if meta else padding_mask, *a, **k)
    saved.append((masking_utils, "_ignore_bidirectional_mask_sdpa", skip))
    masking_utils._ignore_bidirectional_mask_sdpa = ignore
    try:
        yield
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)
