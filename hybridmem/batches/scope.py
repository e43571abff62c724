"""Which `--lengths` runs the closed form's per-shape streams price, and which only the trace
tier's do.

Why (docs/lengths.md, "Why the tiers disagree", measured by experiments/lengths_grid.py): a
shape's reserved bytes come from how the caching allocator carved its segments. The trace
tier's stream is the real op sequence: each op's fp32 upcasts and other transients are
allocated and freed around the saved tensors of the same layer, so best fit carves later saved
tensors out of the freed transients' larger blocks (`_get_free_block`, splitting,
`CUDACachingAllocator.cpp`), and the cache holds fewer, larger segments that a longer batch's
tensors fit once they are free again. The closed form knows each layer's saved tensors and the
sum of its transients, not the per-op order of those transients, so its stream gives every
saved tensor a segment of its own size. On a fresh cache both reserve the same for the
longest shape (the fixed-shape answer), and when the run's first step has its largest shape,
every later step fits in segments carved for a shape at least as large: the two tiers agree.
When a step larger than every step before it comes after smaller ones, its tensors do not fit
the smaller shapes' segments and how many new segments it needs depends on the carving the
closed form does not model: that growth is only the trace tier's.
"""

from __future__ import annotations

import numpy as np

from hybridmem.batches.read import read_lengths
from hybridmem.batches.steps import Steps, plan


def later_larger_step(steps: Steps) -> int | None:
    """The first step whose shape exceeds, in rows, tokens or images, every earlier step's
    (the allocator then needs segments the earlier steps did not carve), None if none does."""
    shapes = np.array([(s.batch, s.tokens, s.images) for s in steps.shapes], dtype=np.int64)
    per_step = shapes[steps.index]
    if len(per_step) < 2:
        return None
    so_far = np.maximum.accumulate(per_step, axis=0)[:-1]
    grows = (per_step[1:] > so_far).any(axis=1)
    return int(np.argmax(grows)) + 1 if grows.any() else None


def closed_form_gap(spec) -> str | None:
    """Why the analytic tier's streams do not price `spec`'s run's reserved growth (the trace
    tier's do), None where they do or `spec` has no lengths (see the module docstring)."""
    if spec.lengths is None:
        return None
    images = -1 if spec.images_per_sample is None else spec.images_per_sample
    return steps_gap(plan(read_lengths(spec.lengths), spec, images))


def steps_gap(steps: Steps) -> str | None:
    """`closed_form_gap` of a planned run."""
    at = later_larger_step(steps)
    if at is None:
        return None
    shape = steps.shapes[int(steps.index[at])]
    return (f"step {at} ({shape.batch} x {shape.tokens} tokens) is larger than every step "
            "before it: the reserved growth it adds depends on how the earlier, smaller steps' "
            "per-op transients carved the cache, which the closed form does not model "
            "(docs/lengths.md)")
