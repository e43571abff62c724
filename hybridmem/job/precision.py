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
