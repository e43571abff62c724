"""CUDA caching-allocator rules the analytic tier applies to every tensor it counts.

Source: PyTorch `c10/cuda/CUDACachingAllocator.cpp` (DESIGN.md, "PyTorch CUDA caching
allocator"): every request is rounded up to a multiple of 512 B (`kMinBlockSize`); a request
above 10 MiB (`kLargeBuffer`/`kMaxSmallAlloc` boundary for its own segment) gets a segment of
its size rounded up to 2 MiB (`kRoundLarge`).
"""

from __future__ import annotations

MiB = 1024**2
MIN_BLOCK = 512          # kMinBlockSize
ROUND_LARGE = 2 * MiB    # kRoundLarge
LARGE_BUFFER = 10 * MiB  # requests above kMinLargeAlloc (10 MiB) get a segment of their own


def t(numel: int, itemsize: int | float) -> int:
    """Allocated bytes of one tensor: numel x itemsize rounded up to 512 B (0 stays 0)."""
    raw = int(-(-numel * itemsize // 1))
    return -(-raw // MIN_BLOCK) * MIN_BLOCK


def segment_waste(nbytes: int) -> int:
    """Reserved-but-unallocated bytes of a tensor's own segment (only for > 10 MiB requests)."""
    if nbytes <= LARGE_BUFFER:
        return 0
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE - nbytes
