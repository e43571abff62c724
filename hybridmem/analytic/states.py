"""Parameters, gradients and optimizer state: bytes per layer, tensor by tensor.

Each tensor is its own allocation (512 B-rounded, `alloc.t`). Dtypes follow the precision
policy (`hybridmem.spec.POLICIES`); tensors with a fixed itemsize (buffers, LoRA adapters in
fp32 as PEFT keeps them by default) keep it.

Optimizer state per stepped tensor of n elements (state dtype s = the dtype of the tensor the
optimizer steps: the fp32 master copy under bf16-master, the parameter itself otherwise):
- adamw / adamw-fused: exp_avg + exp_avg_sq, 2 n s (torch/optim/adam.py `_init_group`,
  `zeros_like(p)`); `step` is a CPU scalar unless fused/capturable; fused keeps a 4-byte device
  scalar (one 512 B block) per tensor.
- adamw-8bit (bitsandbytes `Optimizer8bit.init_state`): n >= 4096 (`min_8bit_size`): state1 +
  state2 uint8 (2 n), absmax1 + absmax2 fp32 per 256-element block, and two 256-entry fp32 qmaps
  shared by all tensors; smaller tensors keep two fp32 states.
- sgd: none; sgd-momentum: momentum_buffer (n s) (torch/optim/sgd.py).
- adafactor (torch/optim/_adafactor.py): >= 2-D: row_var (shape[:-1]) + col_var
  (shape[:-2] + shape[-1:]); 1-D: variance (n); CPU `step`.
- lion (lucidrains/lion-pytorch): exp_avg (n s).
- lora-fa (peft/optimizers/lorafa.py `LoraFAOptimizer.step`, `zeros_like`): exp_avg_B +
  exp_avg_sq_B per lora_B (2 n s; its lora_A is frozen by `create_lorafa_optimizer`: no grad,
  no state), exp_avg + exp_avg_sq per other trained tensor (modules_to_save copies); `step` is
  a Python int.
- bf16-master adds the fp32 master copy (n x 4) of every trainable non-fp32 tensor, made at
  initialisation (DeepSpeed bf16_optimizer.py), counted as optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridmem.analytic.alloc import segment_waste, t
from hybridmem.job.quantize import Quant
from hybridmem.models.graph import Layer, ParamTensor
from hybridmem.spec import PrecisionPolicy

BNB_MIN_8BIT = 4096   # bitsandbytes optim `min_8bit_size` default
BNB_BLOCK = 256       # bitsandbytes blockwise optimizer state: absmax per 256 elements
BNB_QMAP = 256       # one dynamic-quantisation map: 256 fp32 entries (F.create_dynamic_map)
FP32 = 4
BF16 = 2
# aten/src/ATen/native/cuda/MultiTensorApply.cuh `kChunkSize`: elements per chunk of a
# multi-tensor kernel; `_foreach_norm`'s scratch holds one fp32 partial norm per chunk and tensor
FOREACH_CHUNK = 65536
# aten/src/ATen/native/cuda/ForeachReduceOp.cu `_foreach_tensor_norm_cuda_impl`:
# `global_output = at::zeros({320}, opmath)`, allocated even for per-tensor norms
FOREACH_GLOBAL_SLOTS = 320
SCALAR = 1  # a 0-dim tensor: one element, one 512 B block whatever its dtype


@dataclass(frozen=True, slots=True)
class Stepped:
    """One tensor the optimizer steps."""

    numel: int
    shape: tuple[int, ...]
    state: int
    """State itemsize (dtype of the stepped tensor)."""
    lora_b: bool = False
    """A LoRA B matrix (out x r): LoRA-FA projects its gradient (`lorafa_temporary`)."""


@dataclass(frozen=True, slots=True)
class LayerStates:
    param: int
    grad: int
    optimizer: int
    """State + master copies (created lazily at step 0, except master: at init)."""
    master: int
    """The part of `optimizer` that exists from the start (bf16-master fp32 copies)."""
    param_count: int
    trainable_count: int
    stepped: tuple[Stepped, ...]
    waste_param: int
    waste_grad: int
    waste_optimizer: int


def _size(p: ParamTensor, policy: PrecisionPolicy) -> int:
    return p.itemsize if p.itemsize is not None else policy.param_bytes


def state_bytes(s: Stepped, optimizer: str) -> list[int]:
    """Allocations of the optimizer state of one stepped tensor."""
    n = s.numel
    if optimizer in ("adamw", "adamw-fused", "lora-fa"):
        out = [t(n, s.state), t(n, s.state)]
        return out + ([t(1, FP32)] if optimizer == "adamw-fused" else [])
    if optimizer == "adamw-8bit":
        if n < BNB_MIN_8BIT:
            return [t(n, FP32), t(n, FP32)]
        blocks = -(-n // BNB_BLOCK)
        return [t(n, 1), t(n, 1), t(blocks, FP32), t(blocks, FP32)]
    if optimizer in ("sgd-momentum", "lion"):
        return [t(n, s.state)]
    if optimizer == "adafactor":
        if len(s.shape) >= 2:
            row = math.prod(s.shape[:-1])
            col = math.prod(s.shape[:-2]) * s.shape[-1]
            return [t(row, s.state), t(col, s.state)]
        return [t(n, s.state)]
    return []  # sgd


def optimizer_shared_bytes(optimizer: str, stepped: list[Stepped]) -> int:
    """State shared by all tensors: bitsandbytes' two qmaps (only if some tensor is 8-bit)."""
    if optimizer == "adamw-8bit" and any(s.numel >= BNB_MIN_8BIT for s in stepped):
        return 2 * t(BNB_QMAP, FP32)
    return 0


def optimizer_temporary(optimizer: str, stepped: list[Stepped]) -> int:
    """Peak of the short-lived tensors of one optimizer step.

    - adamw (foreach, torch/optim/adam.py `_multi_tensor_adam`): `exp_avg_sq_sqrt =
      torch._foreach_sqrt(exp_avg_sqs)` is a new list sized like all states (one state's worth).
    - adafactor (foreach `_multi_tensor_adafactor`): `var_estimates = row_var @ col_var` is a
      full-size tensor per >= 2-D parameter (the 1-D group's `grads_squared` is freed before its
      clone, and is smaller); the largest group sets the peak.
    - lion (lion-pytorch `update_fn`, per tensor): `exp_avg.clone()...add(grad)` makes two
      tensors the size of the largest parameter.
    - lora-fa: `lorafa_temporary`.
    - fused AdamW, bitsandbytes 8-bit, SGD: in place, none.
    """
    if not stepped:
        return 0
    if optimizer == "lora-fa":
        return lorafa_temporary(stepped)
    if optimizer == "adamw":
        return sum(t(s.numel, s.state) for s in stepped)
    if optimizer == "adafactor":
        multi = sum(t(s.numel, s.state) for s in stepped if len(s.shape) >= 2)
        single = sum(t(s.numel, s.state) for s in stepped if len(s.shape) < 2)
        return max(multi, single)
    if optimizer == "lion":
        return 2 * max(t(s.numel, s.state) for s in stepped)
    return 0


def lorafa_temporary(stepped: list[Stepped]) -> int:
    """Peak of the short-lived tensors of peft's `LoraFAOptimizer.step` (peft 0.21
    peft/optimizers/lorafa.py), one tensor at a time in `named_parameters()` order.

    Per lora_B (out x r, fp32 like its frozen lora_A): `AA_T = A @ A.T` (r x r);
    `pinv(AA_T + delta * eye(r).to(device))`: the fp32 eye, `delta * eye`, their sum, pinv's
    U, Vh and `Vh.mH * S` (r x r each; the SVD's solver workspace is left out) and the result
    `AA_T_inv`; under `autocast(bf16)` (taken when `is_bf16_available()`: Ampere or newer)
    `grad_B_orin @ AA_T_inv` casts both to bf16 and makes a bf16 (out x r) product, times a
    Python scalar another; `.to(B.grad.dtype)` the fp32 `grad_B`; `exp_avg_sq_B.sqrt()` the
    `denom_B`. Other tensors (AdamW branch): `denom = exp_avg_sq.sqrt()`. Each is a loop
    local: the previous tensor's stays alive until its name is bound again."""
    local: dict[str, int] = {}
    peak = 0

    def bind(name: str, size: int, *alongside: int) -> None:
        # `name = <new tensor of size>`, made while `alongside` are alive; then the old dies
        nonlocal peak
        peak = max(peak, sum(local.values()) + size + sum(alongside))
        local[name] = size

    for s in stepped:
        if not s.lora_b:
            bind("denom", t(s.numel, s.state))
            continue
        out, r = s.shape
        rr, half = t(r * r, FP32), t(out * r, BF16)
        bind("AA_T", rr)
        bind("AA_T_inv", rr, *[rr] * 4)          # sum, U, Vh, Vh.mH * S (eye freed by then)
        bind("grad_B", half, half, t(r * r, BF16))  # the product, with the two bf16 casts
        bind("grad_B", half, half)                  # scalar * product
        bind("grad_B", t(out * r, s.state))         # .to(B.grad.dtype)
        bind("denom_B", t(out * r, s.state))
    return peak


def foreach_norm_scratch(numels: list[int]) -> list[int]:
    """Elements of the fp32 scratch tensors CUDA's `_foreach_norm` allocates and frees inside
    the op (ForeachReduceOp.cu): `output_per_tensor` (n tensors x the largest tensor's chunk
    count) and `global_output`. The CPU kernel allocates neither."""
    chunks = max(-(-n // FOREACH_CHUNK) for n in numels) if numels else 0
    return [len(numels) * chunks, FOREACH_GLOBAL_SLOTS]


def clip_temporary(stepped: list[Stepped]) -> int:
    """Peak of the short-lived tensors of `clip_grad_norm_(params, max_norm, foreach=True)`
    (torch/nn/utils/clip_grad.py), over the grads of the stepped tensors (their dtype is the
    state's: bf16-master clips the fp32 master grads).

    `_get_total_norm`: per (device, dtype) group, in first-seen order, `torch._foreach_norm`
    makes one 0-dim norm per tensor, with CUDA's scratch (`foreach_norm_scratch`) and an unused
    0-dim `global_norm` alive inside the op; then `torch.stack(norms)` (n elements, the
    promoted dtype) and its `vector_norm` (0-dim). `_clip_grads_with_norm_` scales in place
    (`_foreach_mul_`) with 0-dim clip coefficients (at most three at once, < the above)."""
    if not stepped:
        return 0
    groups: dict[int, list[Stepped]] = {}
    for s in stepped:
        groups.setdefault(s.state, []).append(s)
    peak = outputs = 0
    for size, group in groups.items():
        outputs += len(group) * t(SCALAR, size)
        inside = sum(t(n, FP32) for n in foreach_norm_scratch([s.numel for s in group]))
        peak = max(peak, outputs + inside + t(SCALAR, size))
    stacked = t(len(stepped), max(groups)) + t(SCALAR, max(groups))
    return max(peak, outputs + stacked)


def layer_states(layer: Layer, policy: PrecisionPolicy, optimizer: str,
                 quant: Quant | None = None) -> LayerStates:
    """Param / grad / optimizer bytes of one layer (base params, buffers, LoRA adapters);
    `quant`: the layer's `quantized` weights are the tensors bitsandbytes keeps
    (`hybridmem.job.quantize.Quant.weight_allocs`), each its own allocation."""
    base = [(p, _size(p, policy)) for p in layer.params]
    lora = [(p, _size(p, policy)) for p in layer.lora + layer.copies]
    buffers = [t(b.numel, _size(b, policy)) for b in layer.buffers]
    params = [t(p.numel, sz) for p, sz in base if p.name not in layer.quantized]
    if layer.quantized:
        params += [t(a.numel, a.itemsize) for p, _ in base if p.name in layer.quantized
                   for a in quant.weight_allocs(*p.shape)]
    params += [t(p.numel, sz) for p, sz in lora]
    with_grad = layer.grad_tensors
    grads = [t(p.numel, p.itemsize or policy.grad_bytes) for p in with_grad]
    stepped = []
    # master copies are made at initialisation for every trainable tensor, graded or not
    # (DeepSpeed flattens all requires_grad params into its fp32 groups)
    masters = [t(p.numel, policy.master_bytes) for p, _ in base
               if policy.master_bytes and layer.trainable]
    # bf16-master: DeepSpeed's fp32 copies of trainable bf16 modules_to_save copies
    masters += [t(p.numel, policy.master_bytes) for p in layer.copies
                if policy.master_bytes and p.itemsize is None]
    for p in with_grad:
        state = FP32 if p.itemsize is not None else policy.state_bytes
        stepped.append(Stepped(p.numel, p.shape, state, lora_b="lora_B." in p.name))
    states = [b for s in stepped for b in state_bytes(s, optimizer)]
    trainable = (layer.num_params if layer.trainable else 0) + sum(
        p.numel for p, _ in lora if not p.frozen)
    return LayerStates(
        param=sum(params) + sum(buffers), grad=sum(grads), optimizer=sum(states) + sum(masters),
        master=sum(masters), param_count=layer.num_params + sum(p.numel for p, _ in lora),
        trainable_count=trainable, stepped=tuple(stepped),
        waste_param=sum(map(segment_waste, params + buffers)),
        waste_grad=sum(map(segment_waste, grads)),
        waste_optimizer=sum(map(segment_waste, states + masters)))
