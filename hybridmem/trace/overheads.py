"""Device memory that no traced tensor stands for: cuBLAS workspaces and the CUDA context.

The analytic tier owns these numbers (`hybridmem.analytic.overheads`); they are imported from
there when it exists so both tiers agree, else the fallbacks below (same sources) are used.
"""

from __future__ import annotations

MiB = 1024**2

# aten/src/ATen/cuda/CublasHandlePool.cpp `getChosenWorkspaceSize`: 32 MiB on Hopper (sm90)
# (4096 KiB : 8 + 16 KiB : 4 ... on older archs); one per (handle, stream), and training holds
# two: the forward's thread and the autograd engine's device thread (DESIGN.md).
CUBLAS_WORKSPACE_BYTES = 32 * MiB
CUBLAS_WORKSPACES = 2
# CUDA context with lazy module loading: ~0.3-0.6 GiB depending on GPU, driver and CUDA
# (DESIGN.md, "Outside PyTorch tensors"); 512 MiB is the middle of that range. The learned tier
# replaces it with a measured value.
CONTEXT_BYTES = 512 * MiB


def workspace_bytes() -> tuple[int, int]:
    """(bytes per cuBLAS workspace, how many) as the analytic tier counts them."""
    try:
        from hybridmem.analytic import overheads
    except ImportError:
        return CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACES
    return (getattr(overheads, "CUBLAS_WORKSPACE_BYTES", CUBLAS_WORKSPACE_BYTES),
            getattr(overheads, "CUBLAS_WORKSPACES", CUBLAS_WORKSPACES))


def context_bytes() -> tuple[int, str]:
    """(CUDA context bytes, where the number came from)."""
    try:
        from hybridmem.analytic import overheads
    except ImportError:
        return CONTEXT_BYTES, "hybridmem.trace.overheads.CONTEXT_BYTES"
    value = getattr(overheads, "CONTEXT_BYTES", None)
    if value is None:
        return CONTEXT_BYTES, "hybridmem.trace.overheads.CONTEXT_BYTES"
    return int(value), "hybridmem.analytic.overheads.CONTEXT_BYTES"
