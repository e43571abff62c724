"""Bytes per element of parameters, grads, optimizer state and activations under each precision.

Its own module so that the technique modules (`job/quantize.py`: the weight dtype of quantised
layers) read it without importing the spec that checks them.
"""

from __future__ import annotations

from dataclasses import dataclass

# dtype of parameters / grads / optimizer state per precision policy, in bytes.
# Source: torch.amp docs (autocast keeps fp32 params), DeepSpeed bf16_optimizer.py (bf16 params
# + fp32 master copy + fp32 Adam state), Megatron `--bf16` with distributed optimizer.
@dataclass(frozen=True, slots=True)
class PrecisionPolicy:
    param_bytes: int
    """Bytes per element of the model's parameters."""
    grad_bytes: int
    """Bytes per element of the .grad tensors."""
    state_bytes: int
    """Bytes per element of each full-precision optimizer state tensor."""
    master_bytes: int
    """Bytes per element of a separate master copy of trainable params (0 = none)."""
    compute_bytes: int
    """Bytes per element of activations (autocast dtype or param dtype)."""


POLICIES: dict[str, PrecisionPolicy] = {
    "fp32": PrecisionPolicy(4, 4, 4, 0, 4),
    "bf16": PrecisionPolicy(2, 2, 2, 0, 2),
    "fp16": PrecisionPolicy(2, 2, 2, 0, 2),
    "bf16-mixed": PrecisionPolicy(4, 4, 4, 0, 2),
    "fp16-mixed": PrecisionPolicy(4, 4, 4, 0, 2),
    "bf16-master": PrecisionPolicy(2, 2, 4, 4, 2),
}



def in_words(precision: str, train: str, strategy: str = "none",
             mp_param_dtype: str = "auto", mp_reduce_dtype: str = "auto") -> str:
    """The precision as the axes users set: weights dtype, compute (autocast) dtype, adapter
    dtype, master weights, and FSDP2's gather / reduce dtypes; for the console's job echo."""
    pol = POLICIES[precision]
    half = "fp16" if precision.startswith("fp16") else "bf16"
    weights = "fp32" if pol.param_bytes == 4 else half
    compute = "fp32" if pol.compute_bytes == 4 else half
    autocast = pol.param_bytes != pol.compute_bytes  # torch.amp: fp32 params, 16-bit compute
    parts = [f"weights {weights}", f"compute {compute}" + (" (autocast)" if autocast else "")]
    if train in ("lora", "peft"):
        parts.append("adapters fp32 (peft)")  # peft autocast_adapter_dtype=True
    parts.append("fp32 master weights" if pol.master_bytes else "no master copy")
    if strategy == "fsdp":
        gather = compute if mp_param_dtype == "auto" else mp_param_dtype
        reduce = gather if mp_reduce_dtype == "auto" else mp_reduce_dtype
        parts.append(f"FSDP2 gather {gather}, reduce {reduce}")
    return ", ".join(parts)
