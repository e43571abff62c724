"""The transformers names the trace tier uses that moved between the releases it supports.

One place per moved name, so the rest of the tier reads the newest spelling. Which releases are
supported: `SUPPORTED` (pyproject.toml's floor; docs/trace.md, "Versions")."""

from __future__ import annotations


def no_init_weights():
    """`no_init_weights`: `transformers.initialization` in 5.x, `modeling_utils` in 4.x."""
    try:
        from transformers.initialization import no_init_weights as ctx
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights as ctx
    return ctx()


def transformers_major() -> int:
    """The installed transformers' major version (metadata only: no import)."""
    from hybridmem.environment import major

    return major("transformers") or 0


def _no_values(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return t.is_meta or isinstance(t, FakeTensor)


def _masked_gather_mode(counts: list[int]):
    """`x[bool_mask]` on meta / fake tensors, the count given: a real run's nonzero makes
    (N, mask.dim()) int64 indices, the index kernel the (N,) gather; the indices are freed
    when the op returns (aten `index.Tensor` on a bool mask, `expandTensors` -> `nonzero`)."""
    import torch
    from torch.overrides import TorchFunctionMode

    class MaskedGather(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if (func is torch.Tensor.__getitem__ and len(args) == 2 and counts
                    and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool
                    and _no_values(args[1])):
                x, mask = args
                n = counts.pop(0)
                idx = torch.empty((n, mask.dim()), dtype=torch.long, device=x.device)
                out = torch.empty((n,), dtype=x.dtype, device=x.device)
                del idx
                return out
            return func(*args, **kwargs)

    return MaskedGather()


def _counted(orig):
    """`get_placeholder_mask` whose count check gathers the features' numel elements per mask
    (image, then video): on the trace's batch the counts match, as the check requires."""
    import functools
    import inspect

    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def method(*args, **kwargs):
        bound = sig.bind_partial(*args, **kwargs).arguments
        counts = [f.numel() for k in ("image_features", "video_features")
                  if (f := bound.get(k)) is not None]
        if not counts or not _no_values(bound["inputs_embeds"]):
            return orig(*args, **kwargs)
        with _masked_gather_mode(counts):
            return orig(*args, **kwargs)
    return method


def placeholder_patches() -> list[tuple[object, str, object]]:
    """(class, "get_placeholder_mask", wrapped) for transformers 4.x's VLMs; none on 5.x,
    whose check reads no tensor value (`torch_compilable_check`, patched in `corrections`)."""
    import importlib
    import sys

    if transformers_major() >= 5:
        return []
    from hybridmem.families import REGISTRY

    # the declared families whose 4.x `get_placeholder_mask` checks the placeholder count by
    # `inputs_embeds[mask].numel()` (`Family.count_check`; transformers 4.57
    # modeling_<name>.py); any other such model already imported is patched too
    for name in (mt for mt, fam in REGISTRY.items() if fam.count_check):
        with _quiet_import():
            importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    patches = []
    for mod_name, mod in list(sys.modules.items()):
        if not (mod_name.startswith("transformers.models.") and ".modeling_" in mod_name):
            continue
        for cls in list(vars(mod).values()):
            if isinstance(cls, type) and "get_placeholder_mask" in vars(cls) \
                    and cls.__module__ == mod_name:
                patches.append((cls, "get_placeholder_mask",
                                _counted(vars(cls)["get_placeholder_mask"])))
    return patches


def _quiet_import():
    """A module a release does not have (e.g. qwen3_vl before 4.57) is skipped."""
    import contextlib

    return contextlib.suppress(ImportError)
