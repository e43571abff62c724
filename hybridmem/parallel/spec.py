"""How a job is spread over GPUs: the `ParallelSpec` part of a TrainingSpec.

Kept in its own module so the parallelism work (DDP, ZeRO, FSDP) can grow it without touching
the single-GPU spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridmem.errors import SpecError

STRATEGIES: tuple[str, ...] = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp")


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelSpec:
    """How the job is spread over GPUs; memory is predicted per rank."""

    world_size: int = 1
    """Number of data-parallel ranks (GPUs)."""
    strategy: Literal["none", "ddp", "zero1", "zero2", "zero3", "fsdp"] = "none"
    """Data-parallel flavour; `none` is a single process."""

    def __post_init__(self) -> None:
        ws = self.world_size
        if isinstance(ws, bool) or not isinstance(ws, int) or ws <= 0:
            raise SpecError("parallel.world_size", ws, reason="must be a positive integer")
        if self.strategy not in STRATEGIES:
            raise SpecError("parallel.strategy", self.strategy, STRATEGIES)
