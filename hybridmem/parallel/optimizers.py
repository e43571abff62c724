"""Optimizer state and step temporaries per trainable element, as the sharding formulas need them.

Kept here (not imported from the analytic tier) because ZeRO changes what the optimizer sees:
one flat 1-D fp32 partition instead of the model's tensors, which changes e.g. Adafactor's
factoring and the size of foreach temporaries.
"""

from __future__ import annotations

from hybridmem.spec import PrecisionPolicy

# Full-size state tensors per trainable element. Sources: torch.optim.AdamW (exp_avg,
# exp_avg_sq), SGD (momentum_buffer), lion-pytorch / bitsandbytes Lion (exp_avg),
# bitsandbytes 8-bit Adam (two uint8 states; the fp32 absmax per 2048-element block is ignored).
STATES: dict[str, int] = {
    "adamw": 2, "adamw-fused": 2, "adamw-8bit": 2, "sgd": 0, "sgd-momentum": 1, "lion": 1,
    "adafactor": 1,  # only when the tensor is 1-D; see `state_bytes`
}
EIGHT_BIT = 1  # bitsandbytes blockwise-quantised state: 1 byte per element

# Temporaries of one optimizer step, in state-sized tensors per element stepped at once.
# torch foreach AdamW materialises `exp_avg_sq.sqrt()` (`_foreach_sqrt`, docs/design.md: pure-bf16
# step peaks at 2*P_all + 8*P_trainable); fused AdamW, SGD and bitsandbytes kernels work in place.
STEP_TEMPS: dict[str, int] = {
    "adamw": 1, "adamw-fused": 0, "adamw-8bit": 0, "sgd": 0, "sgd-momentum": 0, "lion": 1,
    "adafactor": 1,
}


def state_bytes(optimizer: str, policy: PrecisionPolicy, numel: int, dim0: int,
                flat: bool) -> int:
    """Optimizer state bytes (no master copy) for one tensor of `numel` elements.

    Adafactor factors the second moment of a >=2-D tensor into row + column vectors
    (transformers `Adafactor._get_options`: factored = len(shape) >= 2), so it stores
    (rows + cols) floats; on a flat ZeRO partition (`flat`) nothing is factored.
    """
    if optimizer == "adafactor" and not flat and numel != dim0:
        return (dim0 + numel // dim0) * policy.state_bytes
    width = EIGHT_BIT if optimizer == "adamw-8bit" else policy.state_bytes
    return STATES[optimizer] * numel * width


def step_temporary_bytes(optimizer: str, policy: PrecisionPolicy, numel: int) -> int:
    """Transient bytes of one optimizer step over `numel` elements stepped together."""
    return STEP_TEMPS[optimizer] * numel * policy.state_bytes
