"""Op-level selective activation checkpointing (`--grad-ckpt-policy ops`), as torchtitan does it.

torchtitan/distributed/activation_checkpoint.py `_apply_op_sac` (the `_save_list` /
`op_sac_save_list` policy of its 2024-2025 releases): each transformer block is checkpointed
with `torch.utils.checkpoint.create_selective_checkpoint_contexts(policy)`, whose policy marks
MUST_SAVE the outputs of the ops in the save list (`aten.mm`, the SDPA kernels
`_scaled_dot_product_efficient_attention` / `_flash_attention` / `_cudnn_attention`,
`c10d_functional.reduce_scatter_tensor`, `aten.max`), except every second `aten.mm` (a counter
per region and per pass: the 2nd, 4th, ... mm of a block are recomputed), and everything else
PREFER_RECOMPUTE. A fresh counter per checkpointed call (`selective_checkpointing_context_fn`
builds `meta = defaultdict(int)` each time).

So a Llama block (no bias: Linear is `aten.mm`) keeps its input plus, of its seven mms
(q, k, v, o, gate, up, down), the outputs of q, v, gate and down, and SDPA's outputs (out,
logsumexp); in backward the rest is recomputed with those taken from the cache. CLIP's
linears have a bias (`aten.addmm`, not in the list): only SDPA's outputs are kept. On CPU the
SDPA kernel is `_scaled_dot_product_flash_attention_for_cpu`: saved here as the CPU stand-in of
CUDA's flash kernel (the trace tier runs on CPU).

A technique behind `techniques.protocol` (off any axis): the rules live here once;
`job/checkpointing.py` asks the protocol's `checkpoint_kwargs` hook (`techniques.
checkpoint_kwargs`) and hands `context_fn` to transformers' checkpointing (trace tier and
harness); `analytic/sac.py` prices the saved set. torch is imported only when a model runs.
"""

from __future__ import annotations

from collections import defaultdict

from hybridmem.objectives import OBJECTIVES as ALL_OBJECTIVES
from hybridmem.techniques.protocol import Target

NAME = "sac"
AXIS = None  # a checkpointing policy: combines with the other techniques
FLAG = "grad_ckpt_policy"
# priced with every objective the checkpointed layers run under (it changes no loss)
OBJECTIVES: tuple[str, ...] = ALL_OBJECTIVES
POLICY = "ops"


def active(spec) -> bool:
    return bool(spec.grad_ckpt) and spec.grad_ckpt_policy == POLICY


def check(spec) -> None:
    return None  # the policy's syntax and its need of grad_ckpt: the spec's (`ckpt_every`)


def applies(target: Target) -> bool:
    return True  # a dispatch-level policy, for any checkpointed layer


def kept_logits(spec, b: int, s: int, vocab: int, e: int) -> list[tuple[int, int]] | None:
    return None


def note(spec, model_type: str | None = None, applies: bool = True) -> str | None:
    return None  # the analytic tier's own (`analytic/sac.py`)


def install(model, spec, target: Target) -> str | None:
    return None  # applied where checkpointing is switched on (`checkpoint_kwargs`)


def apply_real(model, spec) -> None:
    return None  # likewise on CUDA


def checkpoint_kwargs(spec) -> dict:
    """The non-reentrant checkpoint's kwargs with torchtitan's selective policy."""
    return {"use_reentrant": False, "context_fn": context_fn}


def save_ops() -> set:
    """torchtitan's save list, plus the CPU flash kernel (the trace tier's stand-in)."""
    import torch

    aten = torch.ops.aten
    ops = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default, aten.max.default}
    for name in ("_scaled_dot_product_cudnn_attention",):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    reduce_scatter = getattr(getattr(torch.ops, "_c10d_functional", None),
                             "reduce_scatter_tensor", None)
    if reduce_scatter is not None:
        ops.add(reduce_scatter.default)
    return ops


def context_fn():
    """torchtitan's `selective_checkpointing_context_fn`: a fresh mm counter per region."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = save_ops()
    meta: dict = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[key] += 1
        save = func in ops and not (func == torch.ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
