"""Per-rank memory under data parallelism (DDP, ZeRO-1/2/3, FSDP2)."""

from hybridmem.parallel.spec import ParallelSpec

__all__ = ["ParallelSpec"]
