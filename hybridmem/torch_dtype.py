"""Building models in a dtype: shared by the trace runner and the CUDA harness.

Both build the HF model under `torch.set_default_dtype` rather than `model.to(dtype)`:
`.to()` fails on fake parameters (docs/design.md) and would double the memory of a real build.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# Parameter dtype per precision policy (hybridmem.job.spec.POLICIES gives the byte sizes; bf16 and
# fp16 are both 2 bytes, so the torch dtype needs its own table). *-mixed keeps fp32 params.
PARAM_DTYPE: dict[str, torch.dtype] = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
    "bf16-mixed": torch.float32, "fp16-mixed": torch.float32, "bf16-master": torch.bfloat16,
    "bf16-autocast": torch.bfloat16,
}
# torch dtype of a precision axis' value (`hybridmem.job.precision.DTYPES`: weights, adapters)
AXIS_DTYPE: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                      "fp16": torch.float16}
# Autocast dtype of the *-mixed policies (torch.amp) and of bf16-autocast (bf16 weights under
# bf16 autocast); pure policies run in the param dtype.
AUTOCAST: dict[str, torch.dtype] = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16,
                                    "bf16-autocast": torch.bfloat16}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily make `dtype` the default floating dtype for new tensors and parameters."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
