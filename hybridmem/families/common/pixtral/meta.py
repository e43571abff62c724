"""Pixtral image paths (Mistral-3, LLaVA with a Pixtral tower) on meta tensors, shapes as a
CUDA run has them.

Why: `Mistral3Model.get_image_features` (and `LlavaModel.get_image_features` given
`image_sizes`) splits the projected features per image by
`(torch.as_tensor(image_sizes, device=features.device) // ratio).prod(-1).tolist()`; on meta
that `.tolist()` has no values. The trace batch keeps `image_sizes` a host list
(`Family.pixel_inputs(host_shapes=True)`), so the tensor made from it is put on the CPU,
where its values exist (a CUDA run makes the same two (images, 2) / (images,) int64 tensors on
the device: 512 B blocks, freed before the next op). The placeholder count check, which reads
a meta value, is a no-op: the batch has exactly the rule's image tokens.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

MODULES = {"transformers.models.mistral3.modeling_mistral3": "Mistral3Model",
           "transformers.models.llava.modeling_llava": "LlavaModel"}


class _HostSizes(TorchFunctionMode):
    """`torch.as_tensor(<list>, device=meta)` -> the same tensor on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.as_tensor and args and isinstance(args[0], (list, tuple)):
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type == "meta":
                kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def sizes_on_meta():
    import importlib

    saved = []
    for name, cls_name in MODULES.items():
        mod = importlib.import_module(name)
        cls = getattr(mod, cls_name)
        orig = cls.get_image_features

        @functools.wraps(orig)
        def features(self, *a, _f=orig, **k):
            with _HostSizes():
                return _f(self, *a, **k)
        saved.append((cls, "get_image_features", orig))
        cls.get_image_features = features
        if hasattr(mod, "torch_compilable_check"):  # 5.x; 4.x's check: trace.compat
            saved.append((mod, "torch_compilable_check", mod.torch_compilable_check))
            mod.torch_compilable_check = lambda *a, **k: None
    try:
        yield
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)
