"""The one vocabulary of memory categories, phases and peaks.

Every tier (analytic, trace, learned), the dataset columns and the CLI use these keys, so a
number can be compared across tiers without translation (docs/design.md, "Vocabulary").
"""

from __future__ import annotations

from enum import Enum


class Category(str, Enum):
    """Where a byte of GPU memory goes."""

    PARAM = "param"
    """Model parameters (and buffers), in their storage dtype."""
    GRAD = "grad"
    """Gradients of trainable parameters (fp32 master grads count as optimizer)."""
    OPTIMIZER = "optimizer"
    """Optimizer state and fp32 master weights."""
    ACTIVATION = "activation"
    """Tensors saved by autograd for the backward pass."""
    TEMPORARY = "temporary"
    """Short-lived tensors that set the peak: logits upcast, foreach temporaries, recompute."""
    WORKSPACE = "workspace"
    """Kernel workspaces allocated through the caching allocator (cuBLAS, attention)."""
    CONTEXT = "context"
    """CUDA context and memory allocated outside PyTorch (not a tensor)."""
    FRAGMENTATION = "fragmentation"
    """Reserved minus allocated at the peak: cached but unused allocator blocks."""


CATEGORIES: tuple[str, ...] = tuple(c.value for c in Category)

# Tensor categories are what `torch.cuda.memory_allocated` sees; the rest are outside it.
TENSOR_CATEGORIES: tuple[str, ...] = ("param", "grad", "optimizer", "activation", "temporary")


class Phase(str, Enum):
    """Phases of one training iteration, in order."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    GENERATION = "generation"
    """GRPO's sampling of completions, before the step's first forward
    (`hybridmem.objectives.rules`); listed last so the training phases keep their order."""


PHASES: tuple[str, ...] = tuple(p.value for p in Phase)


def empty_breakdown() -> dict[str, int]:
    """A breakdown with every category present and zero, in the canonical order."""
    return {c: 0 for c in CATEGORIES}
