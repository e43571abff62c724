"""Optimizers for the trace tier, from the one registry (`hybridmem.job.optimizers`).

Each rule builds its CPU form there: torch's AdamW/SGD/Adafactor and transformers' Adafactor run
as they are (`fused=True` AdamW has a CPU kernel with the same in-place memory behaviour as the
CUDA one); lion-pytorch's Lion is pure torch; bitsandbytes optimizers are their layout
emulation (`job.optimizers.BnbLayout`). Here: what only tracing needs (fused AdamW on meta
tensors, LoRA-FA's CUDA behaviour, which state entries are on the host or paged).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.optim import Optimizer

from hybridmem.errors import SpecError
from hybridmem.job.optimizers import LR, rule


def make_optimizer(name: str, params: list[torch.Tensor]) -> Optimizer:
    """The optimizer `name` over `params`, configured as on CUDA (`Rule.build(cuda=False)`)."""
    if name == "lora-fa":
        raise SpecError("optimizer", name, reason="built from the PeftModel: make_lorafa(model)")
    if name == "adamw-fused" and params and params[0].is_meta:
        # torch refuses fused on meta; see `fused_on_meta`
        opt = torch.optim.AdamW(params, lr=LR, foreach=False)
        for group in opt.param_groups:
            group["fused"] = True
        return opt
    return rule(name).build(params, cuda=False)


def make_lorafa(model, lora) -> Optimizer:
    """The registry's LoRA-FA (`job.optimizers.LoraFA.build_from_model`), whose step runs as on
    a bf16-capable CUDA GPU (`lorafa_as_on_cuda`).

    It sets `requires_grad_(False)` on every lora_A, so call it before collecting the trainable
    parameters. Its one param group holds every named parameter (frozen ones are skipped in the
    step: no grad); its state is keyed by name (`...q_proj.lora` for an A/B pair)."""
    opt = rule("lora-fa").build_from_model(model, lora)
    step = opt.step

    @functools.wraps(step)
    def step_as_on_cuda(*args, **kwargs):
        with lorafa_as_on_cuda(opt):
            return step(*args, **kwargs)

    opt.step = step_as_on_cuda
    return opt


@contextlib.contextmanager
def lorafa_as_on_cuda(opt: Optimizer):
    """LoRA-FA's gradient projection runs under `autocast(infer_device(), bfloat16)` when
    `is_bf16_available()` (lorafa.py `step`): on a CUDA GPU (Ampere or newer) a bf16 product
    of bf16 casts. Here: bf16 is available, the device is the CPU (CPU autocast casts the
    fake / real CPU tensors the same way: `mm` is lower-precision on both), and on meta tensors,
    which no autocast touches, CUDA's policy is emulated (`autocast.CudaAutocast`)."""
    from peft.optimizers import lorafa

    saved = lorafa.infer_device, lorafa.is_bf16_available, lorafa.autocast
    meta = any(p.is_meta for g in opt.param_groups for p in g["params"])

    @contextlib.contextmanager
    def emulated(device_type=None, dtype=torch.bfloat16, **_):
        from hybridmem.trace.autocast import CudaAutocast

        mode = CudaAutocast(dtype)
        with mode, mode.region(True):
            yield

    lorafa.infer_device = lambda: "cpu"
    lorafa.is_bf16_available = lambda *a, **k: True
    if meta:
        lorafa.autocast = emulated
    try:
        yield
    finally:
        lorafa.infer_device, lorafa.is_bf16_available, lorafa.autocast = saved


@contextlib.contextmanager
def fused_on_meta():
    """Let fused AdamW step meta tensors: `_fused_adamw_` has a meta kernel, only the Python
    device check (torch/optim/optimizer.py `_device_dtype_check_for_fused`) refuses them."""
    from torch.optim import adam

    check = adam._device_dtype_check_for_fused

    def meta_ok(p, *args, **kwargs):
        return None if p.is_meta else check(p, *args, **kwargs)

    adam._device_dtype_check_for_fused = meta_ok
    try:
        yield
    finally:
        adam._device_dtype_check_for_fused = check


def host_state_keys(name: str) -> tuple[str, ...]:
    """State entries that live on the host on CUDA, so take no device memory (the rule's
    `host_keys`: AdamW's and torch Adafactor's CPU `step` scalars)."""
    return rule(name).host_keys


def paged_tensors(opt: Optimizer) -> list[torch.Tensor]:
    """State the emulated bitsandbytes optimizer put in unified memory (`BnbLayout.paged`)."""
    return list(getattr(opt, "paged", ()))
