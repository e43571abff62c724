"""Liger kernels emulated in torch: the same allocations (shapes, dtypes, lifetimes) as the
Triton kernels (`--loss liger`; the rules are `techniques.liger`), so the trace tier and the CPU stand-in of the harness can run `--liger` jobs.

Why: liger-kernel needs triton and a CUDA GPU; the trace tier runs on CPU / meta tensors. Each
`autograd.Function` below allocates, saves and frees what its Liger counterpart does (source:
liger-kernel 0.8.5, `liger_kernel/ops/*.py`, cited per function), and is patched in the way
`apply_liger_kernel_to_llama(model=...)` patches an instance (monkey_patch.py). The Triton
kernels' arithmetic is not reproduced: the values are not Liger's (they need no memory either
way); the bytes are. On CUDA the harness applies the real kernels (`apply_real`).
"""

from __future__ import annotations

import contextlib
import sys
from types import MethodType

import torch
from torch import nn

from hybridmem.techniques.kernels import IGNORE_INDEX, LIGER_SM_COUNT, flce_chunk_size, shift_labels


def _autocast_on() -> bool:
    """Whether a (real or emulated) CUDA autocast region is active here."""
    on = False
    for device in ("cuda", "cpu"):  # the harness's CUDA run; the fake backend's CPU autocast
        try:
            on = on or torch.is_autocast_enabled(device)
        except (RuntimeError, TypeError):
            pass
    return on


class FusedLinearCrossEntropy(torch.autograd.Function):
    """`LigerFusedLinearCrossEntropyFunction` (ops/fused_linear_cross_entropy.py), reduction
    "mean", no bias, on a CUDA GPU of compute capability >= 8 and torch >= 2.8.

    Forward (`fused_linear_cross_entropy_forward`): grad_input = zeros_like(input); grad_weight
    = zeros_like(weight) if the weight trains; loss_1d (BT, fp32); `target != ignore_index` and
    its sum; then per chunk of `flce_chunk_size` rows: without autocast and with input dtype ==
    weight dtype (`_can_use_mm_out`) one persistent (chunk, V) logits buffer written by
    `torch.mm(out=)` and `torch.mm(out=grad_input[rows])`; else `input_chunk @ weight.t()` (a new
    (chunk, V) tensor; autocast casts the input chunk and the transposed weight view, which is
    not cached) and `grad_input[rows] = grad_logits @ weight` (a (chunk, H) product, copied in).
    The CE kernel writes the logits' gradient in place. grad_weight: `addmm(out=grad_weight,
    out_dtype=fp32)` for fp32 weights and half logits (the input chunk cast to half first),
    `addmm(out=)` for half weights, else `grad_weight += mm(grad_logits.t(), input).float()`.
    Saved: grad_input, grad_weight. Backward (`fused_linear_cross_entropy_backward`): scales them
    in place (a 0-dim `torch.tensor(1.0)` for the comparison) and returns them.
    """

    @staticmethod
    def forward(ctx, _input, weight, target):
        device = _input.device
        bt, h = _input.shape
        v = weight.shape[0]
        size = flce_chunk_size(bt, h, v)
        input_grad = _input.requires_grad
        weight_grad = weight.requires_grad
        grad_input = torch.zeros_like(_input)
        grad_weight = torch.zeros_like(weight) if input_grad and weight_grad else None
        loss_1d = torch.zeros(bt, dtype=torch.float32, device=device)
        target_mask = target != IGNORE_INDEX
        total = target_mask.sum()  # `.item()` on CUDA: a host sync, no device memory
        amp = _autocast_on()
        mm_out = not amp and _input.dtype == weight.dtype and _input.dtype in (
            torch.float16, torch.bfloat16, torch.float32)
        storage = torch.empty((size, v), dtype=_input.dtype, device=device) if mm_out else None
        for start in range(0, bt, size):
            end = min(start + size, bt)
            chunk = _input[start:end]
            if storage is not None:
                logits = storage[: end - start]
                torch.mm(chunk, weight.t(), out=logits)
            else:
                logits = chunk @ weight.t()
            # liger_cross_entropy_kernel: loss into loss_1d, the gradient into `logits`
            grad_logits = logits
            del logits
            if input_grad:
                if mm_out and grad_logits.dtype == grad_input.dtype:
                    torch.mm(grad_logits, weight, out=grad_input[start:end])
                else:
                    grad_input[start:end] = grad_logits @ weight
            if grad_weight is not None and input_grad:
                half = (torch.float16, torch.bfloat16)
                if grad_weight.dtype == torch.float32 and grad_logits.dtype in half:
                    cast = chunk.to(grad_logits.dtype) if chunk.dtype != grad_logits.dtype \
                        else chunk
                    del cast  # addmm(grad_weight, grad_logits.t(), cast, out=grad_weight)
                elif grad_weight.dtype == grad_logits.dtype and grad_logits.dtype in half:
                    cast = chunk.to(grad_logits.dtype) if chunk.dtype != grad_logits.dtype \
                        else chunk
                    del cast  # addmm(grad_weight, grad_logits.t(), cast, out=grad_weight)
                else:
                    grad_weight += torch.mm(grad_logits.t(), chunk).float()
            del grad_logits, chunk
        del storage
        loss = torch.sum(loss_1d)
        del loss_1d, target_mask, total
        ctx.save_for_backward(grad_input.detach(),
                              grad_weight.detach() if grad_weight is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight = ctx.saved_tensors
        # `torch.equal(grad_output, torch.tensor(1.0, device=...))`; else element_mul_kernel
        # scales grad_input / grad_weight in place
        one = torch.tensor(1.0, device=grad_output.device)
        del one
        return grad_input, grad_weight, None


def fused_linear_cross_entropy(hidden_states, weight, labels, hidden_size: int):
    """`LigerForCausalLMLoss` (transformers/model/loss_utils.py): pad + shift the labels,
    flatten, FLCE with reduction "mean" (no `num_items_in_batch` from a plain forward)."""
    target = shift_labels(labels).view(-1)
    return FusedLinearCrossEntropy.apply(hidden_states.view(-1, hidden_size), weight, target)


def lce_forward(self, input_ids=None, labels=None, **kwargs):
    """`lce_forward` (liger_kernel/transformers/model/llama.py, llava.py): the decoder's hidden
    states go straight into the fused loss in training with labels (`skip_logits`); no logits
    are returned."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    outputs = self.model(input_ids=input_ids, **kwargs)
    hidden = outputs[0]
    if self.training and labels is not None:
        size = self.config.get_text_config().hidden_size
        loss = fused_linear_cross_entropy(hidden, self.lm_head.weight, labels, size)
        return CausalLMOutputWithPast(loss=loss, logits=None)
    return CausalLMOutputWithPast(loss=None, logits=self.lm_head(hidden))


class RMSNormFunction(torch.autograd.Function):
    """`LigerRMSNormFunction` (ops/rms_norm.py), casting mode "llama", in_place=True.

    Forward (`rms_norm_forward`): Y = empty (rows, H) in X's dtype, RSTD = empty (rows,) fp32;
    saves X (made contiguous by `ensure_contiguous`), W, RSTD. Backward (`rms_norm_backward`):
    dX is dY itself (in place); `_dW` = (sm_count, H) fp32 when W needs a grad, then
    `_dW.sum(0).to(W.dtype)`."""

    @staticmethod
    def forward(ctx, x, w, eps):
        x = x.contiguous()
        shape = x.shape
        x2 = x.view(-1, shape[-1])
        y = torch.empty_like(x2)
        y.copy_(x2)  # the kernel writes x * rstd * w; any values serve
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x2, w, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        dy = dy.contiguous()
        dw = None
        if ctx.needs_input_grad[1]:
            partial = torch.zeros((LIGER_SM_COUNT, x.shape[-1]), dtype=torch.float32,
                                  device=x.device)
            dw = partial.sum(dim=0).to(w.dtype)
            del partial
        return dy, dw, None


def rms_norm_forward(self, hidden_states):
    """`LigerRMSNorm.forward` bound to an HF RMSNorm instance (`_patch_rms_norm_module`)."""
    eps = getattr(self, "variance_epsilon", None) or getattr(self, "eps", None) or 1e-6
    return RMSNormFunction.apply(hidden_states, self.weight, eps)


class SiLUMulFunction(torch.autograd.Function):
    """`LigerSiLUMulFunction` (ops/swiglu.py): forward c = empty_like(a) (silu(a) * b), saves
    a and b (silu is recomputed in backward); backward writes da, db into a's and b's storage
    and returns them (no new memory)."""

    @staticmethod
    def forward(ctx, a, b):
        a, b = a.contiguous(), b.contiguous()
        shape = a.shape
        a2, b2 = a.view(-1, shape[-1]), b.view(-1, shape[-1])
        c = torch.empty_like(a2)
        torch.mul(a2, b2, out=c)
        ctx.save_for_backward(a2, b2)
        return c.view(shape)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        dc = dc.contiguous()
        shape = dc.shape
        return a.view(shape), b.view(shape)


def swiglu_forward(self, x):
    """`LigerSwiGLUMLP.forward` (transformers/swiglu.py), bound to the HF MLP instance."""
    return self.down_proj(SiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


class RopeFunction(torch.autograd.Function):
    """`LigerRopeFunction` (ops/rope.py): q, k rotated in place in their (b, s, heads, d)
    storage (`q.transpose(1, 2).contiguous()`, a no-op for HF's projections), cos/sin saved;
    backward rotates dq, dk in place."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        q = q.transpose(1, 2).contiguous()
        k = k.transpose(1, 2).contiguous()
        ctx.save_for_backward(cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq, dk):
        dq = dq.transpose(1, 2).contiguous()
        dk = dk.transpose(1, 2).contiguous()
        return dq.transpose(1, 2), dk.transpose(1, 2), None, None


def rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """`liger_rotary_pos_emb` (transformers/rope.py), the Triton backend."""
    return RopeFunction.apply(q, k, cos, sin)


def _text_model(model: nn.Module) -> nn.Module:
    """The decoder stack Liger patches: `getattr(model, base_model_prefix)` for a causal LM,
    `model.model.language_model` for LLaVA (apply_liger_kernel_to_llava)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", base)
    return getattr(inner, "language_model", inner)


def patch_instance(model: nn.Module) -> nn.Module:
    """The instance patches of `apply_liger_kernel_to_llama(model=...)` with the emulated
    kernels: `forward` -> lce_forward, final and per-layer RMSNorms, every MLP -> SwiGLU.
    RoPE is a module-level patch (`rope_patched`). Returns the PEFT-unwrapped model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.forward = MethodType(lce_forward, base)
    text = _text_model(model)
    text.norm.forward = MethodType(rms_norm_forward, text.norm)
    for layer in text.layers:
        layer.mlp.forward = MethodType(swiglu_forward, layer.mlp)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.forward = MethodType(rms_norm_forward, norm)
    return base


@contextlib.contextmanager
def rope_patched(text_type: str):
    """`modeling_<type>.apply_rotary_pos_emb = liger_rotary_pos_emb` (monkey_patch.py), undone
    on exit (Liger's patch is for the process; ours must not outlive the traced job)."""
    name = f"transformers.models.{text_type}.modeling_{text_type}"
    __import__(name)
    module = sys.modules[name]
    saved = module.apply_rotary_pos_emb
    module.apply_rotary_pos_emb = rotary_pos_emb
    try:
        yield
    finally:
        module.apply_rotary_pos_emb = saved


def apply_real(model: nn.Module, config: dict | None = None) -> None:
    """On CUDA: Liger itself, as transformers' Trainer applies it (integrations/liger.py
    `apply_liger_kernel`: `_apply_liger_kernel_to_instance(unwrap_peft_model(model),
    **(liger_kernel_config or {}))`)."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as err:
        raise ImportError(f"--liger needs liger-kernel on the GPU machine "
                          f"(pip install liger-kernel): {err}") from err
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    _apply_liger_kernel_to_instance(model=base, **(config or {}))
