"""Fit verdicts at the GPU's limit: the allocator simulator replayed within the capacity the
caching allocator really has (GPU memory minus the CUDA context, and NCCL per rank).

PyTorch's allocator frees its cached blocks and retries a failed cudaMalloc before raising OOM
(CUDACachingAllocator.cpp `malloc`), so a job whose unlimited reserved peak exceeds the GPU can
still fit. The capacities below are found by the simulator's own path (`allocator.replay` with
`capacity=`) on the tier's stream, independently of `predict`, and then given to `predict` as a
GPU of that memory + the context.
"""

from __future__ import annotations

import pytest

from hybridmem import TrainingSpec
from hybridmem.allocator import AllocatorConfig, SimulatedOOM, replay
from hybridmem.analytic.estimate import _measure
from hybridmem.allocator.overheads import CUDA_CONTEXT_DEFAULT, allocator_capacity
from hybridmem.errors import SpecError
from hybridmem.gpus import GPU
from hybridmem.predict import find_max_micro_batch, predict
from test_analytic_reserved import _default_allocator  # noqa: F401 (autouse: default allocator)

MiB = 2**20
# a tiny config whose approximate stream has cached segments to release at the limit: the first
# of these candidates for which the simulator alone finds such a capacity (`retry_capacity`).
# Which one it is depends on the stream's details (fp32, micro-batch 2 x 2048 when written:
# unlimited reserved ~130 MiB, fits within 129 MiB after a retry), not on the property tested.
CANDIDATES = [TrainingSpec(model="tiny-llama", micro_batch=mb, seq_len=seq, precision=prec)
              for prec in ("bf16", "fp32") for mb in (4, 2, 8) for seq in (2048, 1024, 3072)]
RETRY = "fits only after the allocator released its cache"
OOM = "does not fit: the simulated allocator runs out of memory"


def gpu_with(capacity: int) -> GPU:
    """A GPU whose allocator capacity is `capacity` (compute capability unknown: the cuBLAS
    workspace is the GPU-less default, so the stream is the one `_measure` builds)."""
    return GPU(name="test-gpu", memory_bytes=capacity + CUDA_CONTEXT_DEFAULT, arch="unknown",
               source="test")


def retry_capacity(events) -> int:
    """The largest capacity (1 MiB steps) below the unlimited reserved peak within which the
    stream completes with at least one retry, by the simulator alone."""
    peak = replay(events, AllocatorConfig())
    capacity = peak.peak_reserved - MiB
    while capacity > peak.peak_allocated:
        try:
            if replay(events, AllocatorConfig(), capacity=capacity).num_alloc_retries:
                return capacity
        except SimulatedOOM:
            pass
        capacity -= MiB
    raise AssertionError("no capacity makes this stream fit only after a retry")


def _first_retrying() -> TrainingSpec:
    for spec in CANDIDATES:
        try:
            retry_capacity(_measure(spec)[1])
            return spec
        except AssertionError:
            continue
    raise AssertionError("no candidate's stream fits only after a retry")


SPEC = _first_retrying()


def test_capacity_is_memory_minus_context():
    gpu = gpu_with(100 * MiB)
    assert allocator_capacity(gpu) == 100 * MiB
    with pytest.raises(SpecError):
        allocator_capacity(GPU(name="x", memory_bytes=CUDA_CONTEXT_DEFAULT, arch="unknown",
                               source="test"))


def test_fits_after_allocator_retries():
    capacity = retry_capacity(_measure(SPEC)[1])
    gpu = gpu_with(capacity)
    unlimited = predict(SPEC)
    assert unlimited.peak.device_bytes > gpu.memory_bytes  # said not to fit before
    pred = predict(SPEC, gpu=gpu)
    assert pred.fits is True
    assert pred.peak.reserved_bytes <= capacity < unlimited.peak.reserved_bytes
    assert pred.peak.allocated_bytes == unlimited.peak.allocated_bytes
    assert pred.breakdown["fragmentation"] == pred.peak.reserved_bytes - pred.peak.allocated_bytes
    assert any(RETRY in n for n in pred.notes)
    # the allocator's behaviour at the limit is said: what it reserves without one (the
    # GPU-less answer's reserved bytes, the same tensors)
    assert pred.extras["allocator"] == {"capacity_bytes": capacity, "num_alloc_retries":
                                        pred.extras["allocator"]["num_alloc_retries"],
                                        "oom": False,
                                        "uncapped_reserved_bytes":
                                        unlimited.peak.reserved_bytes}
    assert pred.extras["allocator"]["num_alloc_retries"] >= 1


def test_does_not_fit_when_allocated_exceeds_capacity():
    allocated = predict(SPEC).peak.allocated_bytes
    gpu = gpu_with(allocated - 4 * MiB)
    pred = predict(SPEC, gpu=gpu)
    assert pred.fits is False
    assert pred.peak.reserved_bytes == predict(SPEC).peak.reserved_bytes  # the unlimited replay's
    note = next(n for n in pred.notes if OOM in n)
    assert "the tensors alone (allocated) exceed it" in note
    assert pred.extras["allocator"]["oom"] is True


def test_without_gpu_unchanged():
    """No GPU: no capacity, no allocator notes or extras."""
    pred = predict(SPEC)
    assert "allocator" not in pred.extras
    assert not any("allocator capacity" in n for n in pred.notes)


def test_find_max_batch_monotone_with_capacity():
    capacity = retry_capacity(_measure(SPEC)[1])
    gpu = gpu_with(capacity)
    device = [predict(SPEC.with_(micro_batch=b), gpu=gpu).peak.device_bytes for b in range(1, 10)]
    assert device == sorted(device)
    best = find_max_micro_batch(SPEC, gpu)
    assert best >= SPEC.micro_batch  # the spec itself fits after a retry
    assert predict(SPEC.with_(micro_batch=best), gpu=gpu).fits
    assert not predict(SPEC.with_(micro_batch=best + 1), gpu=gpu).fits


def test_trace_tier_fits_after_retries():
    from hybridmem.trace import run_trace

    spec = SPEC.with_(micro_batch=2)
    capacity = retry_capacity(run_trace(spec).replay_events())
    pred = predict(spec, method="trace", gpu=gpu_with(capacity))
    assert pred.fits is True and pred.peak.reserved_bytes <= capacity
    assert any(RETRY in n for n in pred.notes)
