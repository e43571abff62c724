"""Memory a training process holds on the GPU that is not a PyTorch tensor, as sourced defaults.

The cuBLAS workspace follows the GPU's compute capability when the tiers are given a GPU
(`predict(spec, gpu=...)`); with none, the defaults are for the Hopper GPUs the project targets
first. The learned tier replaces them with measured values (docs/design.md, "Outside PyTorch tensors").
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from hybridmem.errors import SpecError
from hybridmem.gpus import GPU

MiB = 1024**2

CUDA_CONTEXT_DEFAULT = 512 * MiB
"""CUDA context + kernel images with lazy module loading: docs/design.md gives ~0.3-0.6 GiB depending on
GPU, driver and CUDA (measured as NVML process usage minus reserved); 512 MiB is a default inside
that range, not a measurement."""

# PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp `parseChosenWorkspaceSize` (what
# `getChosenWorkspaceSize` returns; pytorch/pytorch 26a39059): with CUBLAS_WORKSPACE_CONFIG unset
# the default is ":4096:2:16:8" (2 x 4096 KiB + 8 x 16 KiB) except "32MiB for Hopper"
# (4096 KiB x 8) when the device's compute capability is 9.0; later releases widen the 32 MiB case
# to "Hopper and Blackwell" (major 9, 10, 12; newest also 11). Allocated through the caching
# allocator (`getNewWorkspace`), so it is part of memory_allocated.
KiB = 1024
WORKSPACE_32MIB_MAJORS = frozenset({9, 10, 11, 12})
"""Compute-capability majors whose default is 32 MiB (the newest rule; sm_90 in every 2.x)."""
WORKSPACE_32MIB = 4096 * KiB * 8
WORKSPACE_OTHER = 4096 * KiB * 2 + 16 * KiB * 8
DEFAULT_CAPABILITY = (9, 0)
"""With no GPU given the tiers price Hopper's workspace (the GPUs the project targets first; the
larger size, so a conservative default); the analytic tier's notes say so."""
_CONFIG_PAIR = re.compile(r":([0-9]+):([0-9]+)")  # the C++ std::regex, verbatim


def default_workspace(capability: tuple[int, int] | None) -> int:
    """PyTorch's default cuBLAS workspace for a compute capability (Hopper's when unknown)."""
    major = (capability or DEFAULT_CAPABILITY)[0]
    return WORKSPACE_32MIB if major in WORKSPACE_32MIB_MAJORS else WORKSPACE_OTHER


def parse_workspace_config(value: str | None, default: int) -> int:
    """CUBLAS_WORKSPACE_CONFIG as PyTorch reads it: the sum of SIZE KiB x COUNT over every
    ":SIZE:COUNT" pair; `default` when unset or when nothing parses (PyTorch warns, then uses
    its default)."""
    if value is None:
        return default
    pairs = _CONFIG_PAIR.findall(value)
    if not pairs:
        return default
    return sum(int(size) * KiB * int(count) for size, count in pairs)


CUBLAS_HANDLES_TRAINING = 2
"""One handle per (thread, device): the forward's thread and the autograd engine's backward thread
(docs/design.md, "Outside PyTorch tensors")."""


def cublas_workspace(gpu: GPU | None = None, environ: Mapping[str, str] = os.environ) -> int:
    """Workspace bytes of one cuBLAS handle on `gpu`, as PyTorch chooses them: its compute
    capability's default, or CUBLAS_WORKSPACE_CONFIG when set. `gpu=None` or a GPU of unknown
    capability (`--gpu-mem`): Hopper's, as before GPUs were told apart."""
    capability = gpu.compute_capability if gpu is not None else None
    return parse_workspace_config(environ.get("CUBLAS_WORKSPACE_CONFIG"),
                                  default_workspace(capability))


def workspace_note(gpu: GPU | None, workspace: int) -> str:
    """The `notes` line that says which cuBLAS workspace size was priced, and why."""
    if gpu is None or gpu.compute_capability is None:
        if workspace == CUBLAS_WORKSPACE_BYTES:  # the line predictions without a GPU always had
            return "workspace: two cuBLAS workspaces of Hopper size (32 MiB each); other GPUs use less"
        return (f"workspace: two cuBLAS workspaces of {workspace} bytes each "
                "(CUBLAS_WORKSPACE_CONFIG)")
    major, minor = gpu.compute_capability  # the size: CublasHandlePool.cpp (cublas_workspace)
    return (f"workspace: two cuBLAS workspaces of {workspace} bytes each ({gpu.name}, "
            f"sm_{major}{minor}: PyTorch's default for this compute capability, or "
            "CUBLAS_WORKSPACE_CONFIG); the one part of the tensors that depends on the GPU")


def allocator_capacity(gpu: GPU, outside: int = CUDA_CONTEXT_DEFAULT) -> int:
    """Bytes PyTorch's caching allocator can reserve on `gpu` before cudaMalloc fails: the
    GPU's total (`GPU.memory_bytes`, cudaMemGetInfo's total) minus what the process holds
    outside the allocator, `outside`:
    - the CUDA context and kernel images, `CUDA_CONTEXT_DEFAULT` (single GPU and every rank);
    - per rank of a multi-GPU job also NCCL's buffers, `hybridmem.parallel.estimate.NCCL_BYTES`
      (NCCL allocates them with cudaMalloc itself, not through PyTorch).
    The cuBLAS workspaces are NOT subtracted: PyTorch allocates them through the caching
    allocator (CublasHandlePool.cpp `getNewWorkspace`), so they are part of what it reserves.
    Why a capacity at all: when cudaMalloc fails, `DeviceCachingAllocator::malloc`
    (c10/cuda/CUDACachingAllocator.cpp) frees its cached blocks (`release_cached_blocks`) and
    retries before raising OOM, so a job's reserved bytes never exceed this figure unless it
    OOMs; the simulator replays exactly that path given this capacity."""
    capacity = gpu.memory_bytes - outside
    if capacity <= 0:
        raise SpecError("gpu", gpu.name, reason=f"{gpu.memory_bytes} bytes leave nothing for "
                        f"PyTorch after {outside} bytes outside its allocator (CUDA context)")
    return capacity


# Names the trace tier reads (hybridmem.trace), so every tier prices the same defaults.
CONTEXT_BYTES = CUDA_CONTEXT_DEFAULT
CUBLAS_WORKSPACE_BYTES = default_workspace(None)
"""The no-GPU default without CUBLAS_WORKSPACE_CONFIG (tests compare against it)."""
