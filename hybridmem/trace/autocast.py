"""CUDA autocast, emulated at the torch-function level for tensors with no autocast of their own.

The fast `meta` backend runs on meta tensors, which `torch.autocast` does not support. This
mode applies CUDA autocast's policies (aten/src/ATen/autocast_mode.cpp, the `KERNEL_CUDA`
lists) above autograd, as autocast does, so the autograd graph and what it saves are the same:
- lower-precision ops cast floating args (not float64) to the autocast dtype; casts of leaf
  fp32 tensors that require grad (parameters) are cached until the outermost autocast region
  exits (`cached_cast` / `can_try_cache`), under no_grad too, which is what keeps a bf16 copy
  of every weight alive through the forward;
- fp32 ops cast floating args to float32;
- fp32_set_opt_dtype ops (softmax, log_softmax, sum, cumsum, prod) get `dtype=float32` when
  no dtype is given and the input is floating;
- promote ops cast to the widest floating dtype among their args.
Only the functions the supported models (Llama/Mistral/Qwen2, CLIP/SigLIP, LLaVA, PEFT LoRA)
call are listed; everything else runs as is, as under autocast.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

T = torch.Tensor
LOWER = {F.linear, torch.matmul, T.matmul, T.__matmul__, T.__rmatmul__, torch.bmm, T.bmm,
         torch.baddbmm, T.baddbmm, torch.addmm, T.addmm, torch.mm, T.mm, torch.mv, T.mv,
         torch.addmv, torch.addbmm, torch.einsum, F.conv1d, F.conv2d, F.conv3d,
         F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
         F.scaled_dot_product_attention, F.prelu}
FP32 = {F.layer_norm, F.group_norm, torch.pow, T.pow, T.__pow__, torch.exp, T.exp,
        torch.log, T.log, torch.rsqrt, T.rsqrt, F.softplus, F.nll_loss, F.mse_loss,
        F.l1_loss, F.smooth_l1_loss, F.binary_cross_entropy_with_logits, torch.cdist,
        torch.logsumexp, T.logsumexp}
SET_OPT_DTYPE = {F.softmax, torch.softmax, T.softmax, F.log_softmax, torch.log_softmax,
                 T.log_softmax, torch.sum, T.sum, torch.cumsum, T.cumsum, torch.prod, T.prod}
PROMOTE = {torch.cat, torch.stack, torch.addcmul, torch.addcdiv, T.index_put, T.index_put_,
           torch.index_copy, T.index_copy, torch.scatter_add, T.scatter_add}


def _eligible(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


class CudaAutocast(TorchFunctionMode):
    """Active for the whole run; casts only inside `region(True)` (the forward, recomputes)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.enabled = False
        self.depth = 0
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @contextlib.contextmanager
    def region(self, enabled: bool = True):
        """An autocast region; the cache is cleared when the outermost region exits."""
        saved = self.enabled
        self.enabled = enabled
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            self.enabled = saved
            if self.depth == 0:
                self.cache.clear()

    def _lower(self, x):
        if not _eligible(x) or x.dtype == self.dtype:
            return x
        # `can_try_cache` (autocast_mode.cpp `cached_cast`, torch 2.13) tests inference mode,
        # not grad mode, and a cast it caches is made under `AutoGradMode(true)`: one made
        # under no_grad (or in an autograd Function's forward) is cached with its grad_fn,
        # stays alive to the region's exit and is reused by a later forward with grad
        cacheable = (x.dtype == torch.float32 and x.requires_grad and x.is_leaf
                     and not x._is_view() and not torch.is_inference_mode_enabled())
        if not cacheable:
            return x.to(self.dtype)
        hit = self.cache.get(id(x))
        if hit is None or hit[0] is not x:
            with torch.enable_grad():
                hit = self.cache[id(x)] = (x, x.to(self.dtype))
        return hit[1]

    def _map(self, fn, args, kwargs):
        def one(a):
            if isinstance(a, (list, tuple)):
                return type(a)(one(b) for b in a)
            return fn(a)
        return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.enabled:
            return func(*args, **kwargs)
        if func in LOWER:
            args, kwargs = self._map(self._lower, args, kwargs)
        elif func in FP32:
            args, kwargs = self._map(lambda a: a.float() if _eligible(a) else a, args, kwargs)
        elif func in SET_OPT_DTYPE:
            if _eligible(args[0] if args else None) and kwargs.get("dtype") is None and \
                    not _dtype_positional(func, args):
                kwargs = {**kwargs, "dtype": torch.float32}
        elif func in PROMOTE:
            floats = [a for a in _leaves(args, kwargs) if _eligible(a)]
            if floats:
                wide = max((a.dtype for a in floats), key=lambda d: torch.finfo(d).bits)
                args, kwargs = self._map(lambda a: a.to(wide) if _eligible(a) else a,
                                         args, kwargs)
        return func(*args, **kwargs)


def _leaves(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _dtype_positional(func, args) -> bool:
    """softmax(x, dim, dtype) / sum(x, dim, keepdim, dtype=...): a dtype given by position."""
    return any(isinstance(a, torch.dtype) for a in args[1:])


@contextlib.contextmanager
def emulated(mode: CudaAutocast):
    """Route transformers' `maybe_autocast` and `torch.is_autocast_enabled` to `mode` (meta).

    transformers' `maybe_autocast` is a no-op on meta tensors and `torch.autocast` refuses the
    meta device, so the model's own "autocast off here" regions (RoPE in fp32) would be lost.
    transformers 4.x has no `maybe_autocast`: `meta_torch_autocast` stands in.
    """
    from transformers.utils import generic

    def maybe_autocast(device_type, dtype=None, enabled=True, cache_enabled=None):
        return mode.region(enabled)

    is_enabled = torch.is_autocast_enabled

    def is_autocast_enabled(*args):
        if mode.enabled:
            return True
        try:
            return is_enabled(*args)
        except RuntimeError:
            return False

    saved = getattr(generic, "maybe_autocast", None)
    targets = [m for name, m in list(sys.modules.items())
               if saved is not None and name.startswith("transformers")
               and getattr(m, "maybe_autocast", None) is saved]
    for m in targets:
        m.maybe_autocast = maybe_autocast
    torch.is_autocast_enabled = is_autocast_enabled
    try:
        with mode:
            yield mode
    finally:
        for m in targets:
            m.maybe_autocast = saved
        torch.is_autocast_enabled = is_enabled


@contextlib.contextmanager
def meta_torch_autocast(mode: CudaAutocast | None):
    """`torch.autocast(device_type="meta", ...)`, which torch refuses, as the emulated region
    (no region without autocast). transformers 4.x opens it with the tensor's device type
    (4.57 modeling_llama.py, the rotary embedding's "force float32"); other devices unchanged."""
    original = torch.autocast

    def autocast(device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type == "meta":
            return mode.region(enabled) if mode is not None else contextlib.nullcontext()
        return original(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    torch.autocast = autocast
    try:
        yield
    finally:
        torch.autocast = original


def wrap_checkpointing(model: torch.nn.Module, mode: CudaAutocast | None, *outer) -> None:
    """Make checkpoint recomputes run under the same torch-function modes as the forward.

    On meta tensors the autograd engine runs backward (hence recomputes) on a device thread
    that does not inherit torch-function modes; real autocast is carried over by checkpoint.py
    (`_get_autocast_kwargs`), the emulated one and `outer` modes (e.g. the SDPA redirect) are
    re-entered here, the autocast region with the state it had in the forward.
    """
    for m in model.modules():
        func = getattr(m, "_gradient_checkpointing_func", None)
        if func is None or getattr(func, "_hybridmem", False):
            continue

        def ckpt(fn, *args, _func=func, **kwargs):
            enabled = mode.enabled if mode is not None else False

            def run(*a, **k):
                active = torch.overrides._get_current_function_mode_stack()
                with contextlib.ExitStack() as stack:
                    for cls in outer:
                        if not any(isinstance(x, cls) for x in active):
                            stack.enter_context(cls())
                    if mode is not None:
                        if mode not in active:
                            stack.enter_context(mode)
                        stack.enter_context(mode.region(enabled))
                    return fn(*a, **k)
            return _func(run, *args, **kwargs)

        ckpt._hybridmem = True
        m._gradient_checkpointing_func = ckpt
