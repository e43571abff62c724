"""The fast meta backend (CUDA autocast emulated) gives the same bytes as FakeTensorMode.

FakeTensorMode with CPU fakes is checked against a real CPU run in test_trace.py; here the
meta run must match it: same peak and the same category totals at the peak. Known small
differences away from the peak (docs/trace.md): `layer_norm` on bf16 input saves fp32
mean/rstd on meta (as CUDA does) but bf16 ones on CPU; scalars made by `torch.tensor()` inside
an optimizer step are not dispatched on meta.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from hybridmem.models import load_config
from hybridmem.job.spec import LoraSpec, TrainingSpec
from hybridmem.trace import runner
from hybridmem.trace.tracker import round_size

GRID = [
    dict(precision="fp32", attn="eager"),
    dict(precision="bf16", grad_ckpt=True),
    dict(precision="bf16-mixed"),
    dict(precision="bf16-mixed", grad_ckpt=True, train="llm+projector"),
    dict(precision="bf16-mixed", train="lora", lora=LoraSpec(r=4)),
    dict(precision="bf16-master", grad_ckpt=True, optimizer="adafactor"),
    dict(precision="fp16-mixed", optimizer="adamw-fused", train="projector", grad_ckpt=True),
    dict(precision="bf16", optimizer="adamw-8bit"),
    dict(precision="fp32", optimizer="lion", train="llm+projector"),
    dict(model="tiny-llama", precision="bf16-mixed", optimizer="sgd", grad_ckpt=True,
         train="lora"),
]


def _summary(spec: TrainingSpec, backend: str):
    tracker, _ = runner.trace(spec, load_config(spec.model), backend=backend)
    curve = tracker.live_curve()
    peak = int(curve.argmax())
    cats = Counter()
    for s in tracker.live_at(peak):
        if s.category != "host":
            cats[s.category] += round_size(s.nbytes)
    return int(curve[peak]), dict(cats)


@pytest.mark.parametrize("kw", GRID, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_meta_backend_equals_fake(kw):
    spec = TrainingSpec(**{"model": "tiny-llava", "micro_batch": 2, "seq_len": 64, **kw})
    assert _summary(spec, "meta") == _summary(spec, "fake")


def test_meta_sdpa_runs_the_cpu_flash_kernel():
    # without the redirect, meta SDPA decomposes to the math path and saves S x S weights
    spec = TrainingSpec(model="tiny-llava", micro_batch=2, seq_len=64, precision="fp32")
    tracker, _ = runner.trace(spec, load_config(spec.model), backend="meta")
    ops = {str(s.op) for s in tracker.storages}
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in ops
    assert "aten._safe_softmax.default" not in ops


class _Linear(torch.autograd.Function):
    """A forward run under no_grad inside an autograd Function, as liger's fused CE runs."""

    @staticmethod
    def forward(ctx, x, w):
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, grad):
        return None, None


def _cast_cache(device: str, region, steps) -> tuple:
    """Weight casts made, which outputs carry a grad path and whether the weight gets a grad,
    for a run of linears in one autocast region (each step: grad, no_grad or a Function)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    w = torch.nn.Parameter(torch.randn(4, 4, device=device))
    x = torch.randn(2, 4, device=device)

    class Casts(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].shape == w.shape:
                Casts.n += 1
            return func(*args, **(kwargs or {}))

    outs = []
    with Casts(), region():
        for step in steps:
            if step == "function":
                outs.append(_Linear.apply(x, w))
            else:
                with torch.set_grad_enabled(step == "grad"):
                    outs.append(F.linear(x, w))
    grads = [o for o in outs if o.grad_fn is not None and not isinstance(o.grad_fn,
                                                                          _Linear._backward_cls)]
    if grads:
        sum(o.sum() for o in grads).backward()
    return Casts.n, [o.grad_fn is not None for o in outs], w.grad is not None


@pytest.mark.parametrize("steps", [("no_grad", "grad"), ("grad", "no_grad"),
                                   ("no_grad", "no_grad"), ("function", "grad"),
                                   ("grad", "grad")])
def test_emulated_autocast_caches_casts_as_torch_does(steps):
    # the oracle: torch's own autocast (CPU, bf16), whose `cached_cast` the emulation follows
    from hybridmem.trace.autocast import CudaAutocast

    mode = CudaAutocast(torch.bfloat16)

    @contextlib.contextmanager
    def emulated():
        with mode, mode.region():
            yield

    real = _cast_cache("cpu", lambda: torch.autocast("cpu", dtype=torch.bfloat16), steps)
    assert _cast_cache("meta", emulated, steps) == real
