"""Building models in a dtype: shared by the trace runner and the CUDA harness.

Both build the HF model under `torch.set_default_dtype` rather than `model.to(dtype)`:
`.to()` fails on fake parameters (DESIGN.md) and would double the memory of a real build.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily make `dtype` the default floating dtype for new tensors and parameters."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
