"""Parameters, gradients and optimizer state: bytes per layer, tensor by tensor.

Each tensor is its own allocation (512 B-rounded, `alloc.t`). Dtypes follow the precision
policy (`hybridmem.job.spec.POLICIES`); tensors with a fixed itemsize (buffers, LoRA adapters in
fp32 as PEFT keeps them by default) keep it.

Optimizer state, shared state and step temporaries come from the one optimizer registry
(`hybridmem.job.optimizers`, each rule citing its library source); here they are priced as
CUDA allocations (512 B-rounded). Paged state (bitsandbytes `paged_*`) lives in unified memory
outside the allocator: `LayerStates.paged`, never in `optimizer`.

bf16-master adds the fp32 master copy (n x 4) of every trainable non-fp32 tensor, made at
  initialisation (DeepSpeed bf16_optimizer.py), counted as optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmem.allocator.alloc import segment_waste, t
from hybridmem.allocator.foreach import foreach_norm_scratch
from hybridmem.job.optimizers import Stepped, raw, rule
from hybridmem.techniques.quantize import Quant
from hybridmem.models.graph import Layer, ParamTensor
from hybridmem.job.spec import PrecisionPolicy

FP32 = 4
SCALAR = 1  # a 0-dim tensor: one element, one 512 B block whatever its dtype


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
    paged: int = 0
    """Optimizer state in CUDA unified memory (bitsandbytes paged), outside the allocator."""


def _size(p: ParamTensor, policy: PrecisionPolicy) -> int:
    return p.itemsize if p.itemsize is not None else policy.param_bytes


def state_bytes(s: Stepped, optimizer: str) -> list[int]:
    """Allocations of the optimizer state of one stepped tensor (through the allocator)."""
    return [t(*a) for a in rule(optimizer).state(s)]


def paged_bytes(s: Stepped, optimizer: str) -> int:
    """Bytes of the state of one stepped tensor in unified memory (raw: cudaMallocManaged)."""
    return sum(raw(*a) for a in rule(optimizer).paged_state(s))


def optimizer_shared_bytes(optimizer: str, stepped: list[Stepped]) -> int:
    """State shared by all tensors (bitsandbytes' qmaps, only if some tensor is 8-bit)."""
    return sum(t(*a) for a in rule(optimizer).shared(stepped))


def optimizer_temporary(optimizer: str, stepped: list[Stepped]) -> int:
    """Peak of the short-lived tensors of one optimizer step (the rule's `temporary`)."""
    return rule(optimizer).temporary(stepped, t) if stepped else 0


def lorafa_temporary(stepped: list[Stepped]) -> int:
    """LoRA-FA's step temporaries as allocations (`job.optimizers.lorafa_temporary`)."""
    return rule("lora-fa").temporary(stepped, t)


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
    (`hybridmem.techniques.quantize.Quant.weight_allocs`), each its own allocation."""
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
        waste_optimizer=sum(map(segment_waste, states + masters)),
        paged=sum(paged_bytes(x, optimizer) for x in stepped))
