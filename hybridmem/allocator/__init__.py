"""A simulator of PyTorch's CUDA caching allocator: an alloc/free stream in, reserved bytes out.

Shared by the trace tier (its recorded stream) and the analytic tier (an approximate stream it
builds from its closed forms); pure Python, so the analytic tier stays free of torch.

What the trace tier records is what PyTorch *allocates*; what a GPU runs out of is what the
caching allocator *reserves* (segments from cudaMalloc, or pages from cuMemMap with expandable
segments). The simulator replays the allocator's decisions rule by rule from
`c10/cuda/CUDACachingAllocator.cpp` (`DeviceCachingAllocator`, read at pytorch/pytorch commit
001074d2) and the shared code it moved to in newer releases (`c10/core/CachingDeviceAllocator.h`,
`c10/core/AllocatorConfig.{h,cpp}`).

Known limitations (what the simulator does not see, and roughly how much it matters):
- CUDA-graph private pools and `torch.cuda.MemPool` are not modelled (no graphs in training here);
- `record_stream` / cross-stream uses: a free completes at once; real frees of blocks used on a
  side stream wait for an event, so reserved can be higher there (NCCL / prefetch streams);
- the OOM path runs only with a `capacity`: without one the simulator never frees cached
  segments, as PyTorch does until it hits the device limit; `garbage_collection_threshold` acts
  only with a `capacity`, as it needs `set_per_process_memory_fraction` in PyTorch;
- simulated segment addresses grow monotonically; real cudaMalloc addresses can be reused,
  which only changes ties between equal-sized free blocks;
- the newest shared `BlockComparatorSize` orders free blocks by size before stream; this file
  follows the CUDA file's (stream, size, address) order: identical on a single stream;
- memory outside the allocator (CUDA context, NCCL buffers, cuBLAS/cuDNN handles' own memory)
  is not reserved bytes and is not here.

Public API (agreed with the tracker):
- `AllocatorConfig` (+ `from_env`, `from_environ`): the options that change memory,
  `config.py`;
- `CachingAllocatorSim`: malloc/free/empty_cache with allocated/reserved peaks, `sim.py`;
- `replay`, `replay_snapshot`, `ReplayResult`: streams and real `torch.cuda.memory._snapshot()`
  traces, `replay.py`.
"""

from __future__ import annotations

from hybridmem.allocator.config import AllocatorConfig, division_table
from hybridmem.allocator.replay import ReplayResult, replay, replay_snapshot
from hybridmem.allocator.sim import (
    CachingAllocatorSim, SimulatedOOM, get_allocation_size, round_size,
)

__all__ = [
    "AllocatorConfig", "CachingAllocatorSim", "ReplayResult", "SimulatedOOM", "division_table",
    "get_allocation_size", "replay", "replay_snapshot", "round_size",
]
