"""Scratch that CUDA's multi-tensor `_foreach_norm` kernel allocates inside the op: a kernel rule,
read by the analytic tier (`analytic/states.py`, `events.py`) and emulated on meta tensors by the
trace tier (`trace/corrections.py`), so both price the same bytes."""

from __future__ import annotations

# aten/src/ATen/native/cuda/MultiTensorApply.cuh `kChunkSize`: elements per chunk of a
# multi-tensor kernel; `_foreach_norm`'s scratch holds one fp32 partial norm per chunk and tensor
FOREACH_CHUNK = 65536
# aten/src/ATen/native/cuda/ForeachReduceOp.cu `_foreach_tensor_norm_cuda_impl`:
# `global_output = at::zeros({320}, opmath)`, allocated even for per-tensor norms
FOREACH_GLOBAL_SLOTS = 320


def foreach_norm_scratch(numels: list[int]) -> list[int]:
    """Elements of the fp32 scratch tensors CUDA's `_foreach_norm` allocates and frees inside
    the op (ForeachReduceOp.cu): `output_per_tensor` (n tensors x the largest tensor's chunk
    count) and `global_output`. The CPU kernel allocates neither."""
    chunks = max(-(-n // FOREACH_CHUNK) for n in numels) if numels else 0
    return [len(numels) * chunks, FOREACH_GLOBAL_SLOTS]
