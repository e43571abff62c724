"""Qwen3-VL's DeepStack row selection on meta tensors, as a real run of our batch does it.

Why its own module: `Qwen3VLTextModel._deepstack_process` adds each DeepStack merger's
features to the image-token rows of the first LM layers' outputs with a boolean row mask
(`hidden_states[visual_pos_masks, :]`, then `hidden_states[visual_pos_masks, :] = ...`), and
the backward of both ops indexes by the same mask. A bool index reads values (`nonzero`), which
meta tensors do not have. The count of True rows is known: the image features' rows, which
`get_placeholder_mask` checks against the image tokens.

The fix sits below autograd (a `TorchDispatchMode` entered before the storage tracker, so the
tracker sees only the op's outputs, as on a real run): autograd still saves the bool mask (the
`visual_pos_masks` view the model holds anyway), and only the kernel gets the long indices a
real kernel makes internally from the mask (`aten/src/ATen/native/IndexingUtils.h
expandTensors`: `nonzero`, one long tensor per masked dim, freed inside the op).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MODULES = ("transformers.models.qwen3_vl.modeling_qwen3_vl",
           "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe")
"""transformers modules whose model classes have `_deepstack_process` / `get_placeholder_mask`."""

_INDEX_OPS = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default,
              torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default}


class MaskedRowsOnMeta(TorchDispatchMode):
    """Index ops with a meta bool mask -> the same ops with `rows` long indices per masked dim."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: int | None = None  # True entries of the mask (set by get_placeholder_mask)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INDEX_OPS and self.rows is not None and len(args) > 1:
            indices = args[1]
            if any(isinstance(i, torch.Tensor) and i.is_meta and i.dtype == torch.bool
                   for i in indices):
                args = (args[0], self._long(indices), *args[2:])
        return func(*args, **kwargs)

    def _long(self, indices):
        out = []
        for i in indices:
            if isinstance(i, torch.Tensor) and i.is_meta and i.dtype == torch.bool:
                out += [torch.empty(self.rows, dtype=torch.long, device="meta")] * i.dim()
            else:
                out.append(i)
        return out


@contextlib.contextmanager
def deepstack_rows_on_meta():
    """Answer Qwen3-VL's bool row masks on meta with the image-feature row count."""
    import importlib

    mode = MaskedRowsOnMeta()
    saved = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # an older transformers without the family
            continue
        for cls in vars(mod).values():
            if isinstance(cls, type) and "get_placeholder_mask" in vars(cls):
                orig = cls.get_placeholder_mask

                @functools.wraps(orig)
                def placeholder(self, *a, _f=orig, image_features=None, video_features=None,
                                **k):
                    feats = image_features if image_features is not None else video_features
                    if feats is not None and feats.is_meta:
                        mode.rows = feats.shape[0]
                    return _f(self, *a, image_features=image_features,
                              video_features=video_features, **k)
                saved.append((cls, "get_placeholder_mask", orig))
                cls.get_placeholder_mask = placeholder
    try:
        with mode:
            yield
    finally:
        for obj, attr, old in reversed(saved):
            setattr(obj, attr, old)
