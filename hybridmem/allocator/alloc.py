"""CUDA caching-allocator rules the analytic tier applies to every tensor it counts.

Source: PyTorch `c10/cuda/CUDACachingAllocator.cpp` (docs/design.md, "PyTorch CUDA caching
allocator"), with the constants and `get_allocation_size` of the simulator
(`hybridmem.allocator`): every request is rounded up to a multiple of 512 B (`kMinBlockSize`);
a request of 10 MiB (`kMinLargeAlloc`) or more gets a segment of its size rounded up to 2 MiB
(`kRoundLarge`).
"""

from __future__ import annotations

from hybridmem.allocator.config import K_MIN_BLOCK_SIZE, K_MIN_LARGE_ALLOC
from hybridmem.allocator.sim import get_allocation_size


def t(numel: int, itemsize: int | float) -> int:
    """Allocated bytes of one tensor: numel x itemsize rounded up to 512 B (0 stays 0)."""
    raw = int(-(-numel * itemsize // 1))
    return -(-raw // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def segment_waste(nbytes: int) -> int:
    """Reserved-but-unallocated bytes of a tensor's own segment (only for >= 10 MiB requests)."""
    if nbytes < K_MIN_LARGE_ALLOC:
        return 0
    return get_allocation_size(nbytes) - nbytes
