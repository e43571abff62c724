"""Memory a training process holds on the GPU that is not a PyTorch tensor, as sourced defaults.

estimate() gets no GPU, so the defaults are for the Hopper GPUs the project targets first;
the learned tier replaces them with measured values (DESIGN.md, "Outside PyTorch tensors").
"""

from __future__ import annotations

MiB = 1024**2

CUDA_CONTEXT_DEFAULT = 512 * MiB
"""CUDA context + kernel images with lazy module loading: DESIGN.md gives ~0.3-0.6 GiB depending on
GPU, driver and CUDA (measured as NVML process usage minus reserved); 512 MiB is a default inside
that range, not a measurement."""

# PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp `getChosenWorkspaceSize`: CUBLAS_WORKSPACE_CONFIG
# default ":4096:8" (8 x 4096 KiB = 32 MiB) on sm90 (Hopper) and newer, ":4096:2:16:8"
# (2 x 4096 KiB + 8 x 16 KiB) before. Allocated through the caching allocator, so it is part of
# memory_allocated.
CUBLAS_WORKSPACE: dict[str, int] = {
    "hopper": 32 * MiB,
    "blackwell": 32 * MiB,
    "ampere": 2 * 4096 * 1024 + 8 * 16 * 1024,
    "ada": 2 * 4096 * 1024 + 8 * 16 * 1024,
    "turing": 2 * 4096 * 1024 + 8 * 16 * 1024,
    "volta": 2 * 4096 * 1024 + 8 * 16 * 1024,
}
DEFAULT_ARCH = "hopper"
CUBLAS_HANDLES_TRAINING = 2
"""One handle per (thread, device): the forward's thread and the autograd engine's backward thread
(DESIGN.md, "cuBLAS workspace")."""


def cublas_workspace(arch: str = DEFAULT_ARCH) -> int:
    """Workspace bytes of one cuBLAS handle on `arch` (Hopper's when unknown)."""
    return CUBLAS_WORKSPACE.get(arch, CUBLAS_WORKSPACE[DEFAULT_ARCH])


# Names the trace tier reads (hybridmem.trace), so every tier prices the same defaults.
CONTEXT_BYTES = CUDA_CONTEXT_DEFAULT
CUBLAS_WORKSPACE_BYTES = cublas_workspace()
