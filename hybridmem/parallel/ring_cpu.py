"""torch's ring attention (`context_parallel`) on the CPU flash-attention kernel.

Why: `torch.distributed.tensor.experimental.context_parallel` patches
`F.scaled_dot_product_attention` to wrap q, k, v as `Shard(2)` DTensors on the cp mesh
(`_ContextParallel.sdpa_input_fn`); DTensor's dispatcher then sends the SDPA *backend* op the
composite picks to `_sdpa_handler`, which runs `_templated_ring_attention` (forward) or
`_templated_ring_attention_backward` with that backend op as the per-chunk kernel
(torch 2.13 `distributed/tensor/experimental/_context_parallel/_attention.py`: `custom_ops`
maps CUDA's `_scaled_dot_product_flash_attention`, `_efficient_attention` and
`_cudnn_attention` and their backwards; `_sharding_rules.register_cp_sharding_rules` adds their
`Shard(2)` strategies). On a CPU tensor the composite picks
`_scaled_dot_product_flash_attention_for_cpu`, which is in neither table, hence the
`NotImplementedError` a plain CPU run of `context_parallel` raises.

This module adds that op (and its backward) to both tables the same way, so a CPU or fake-tensor
rank runs torch's own ring code: the K/V `torch.cat`, the rotater's all-gather (or all-to-all),
the per-chunk kernel, the `_SDPAMerger` merges (fp32 upcast, `_cp_options.convert_to_f32`), and
the backward's fp32 dQ/dK/dV accumulators and dK/dV all-to-all. Only the per-chunk kernel
differs from CUDA's flash op, and its outputs are the same bytes (`torch/_meta_registrations.py`:
CPU flash forward returns `output` shaped like `query` and `logsumexp` (B, H, L) in the
computation dtype, fp32 for bf16/fp32 inputs; CUDA flash's `logsumexp` is (B, H, L) fp32; their
backwards return dQ/dK/dV shaped like q/k/v). What neither shows at the dispatch level is the
kernel's internal scratch (CPU flash's per-thread blocks; CUDA flash backward's fp32
`dq_accum` and `softmax_d`, which the analytic tier counts).
"""

from __future__ import annotations

import contextlib

import torch

aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQ_DIM = 2  # as torch's `_sharding_rules.SEQ_DIM`: q/k/v are (batch, heads, seq, head_dim)


def _forward_strategy(op_schema):
    """`Shard(2)` on output, logsumexp, q, k, v: torch's CUDA flash CP strategy
    (`_scaled_dot_product_flash_attention_cp_strategy`) for the CPU op's two outputs."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Shard

    placements = [Shard(SEQ_DIM)] * 5  # output, logsumexp | q, k, v
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema,
                                           [placements], input_index=2)


def _backward_strategy(op_schema):
    """As torch's `_scaled_dot_product_flash_attention_backward_cp_strategy`: dQ/dK/dV and
    grad_out, q, k, v, out, logsumexp `Shard(2)`, any further tensor input replicated."""
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    tensors = sum(isinstance(a, OpStrategy) for a in op_schema.args_schema)
    placements = [Shard(SEQ_DIM)] * 9 + [Replicate()] * (tensors - 6)
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(validate=False),
                                           op_schema, [placements], input_index=3)


def _ring_forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                  scale=None):
    from torch.distributed.tensor.experimental._context_parallel import _attention

    if attn_mask is not None:  # torch's ring attention takes no mask (`attn_bias` refused)
        raise NotImplementedError("context parallelism runs SDPA without a mask (is_causal)")
    return _attention._templated_ring_attention(
        mesh.get_group(), SEQ_DIM, FORWARD, query=query, key=key, value=value,
        is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _ring_backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                   attn_mask=None, scale=None):
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention._templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, BACKWARD, grad_out=grad_out, grad_out_name="grad_out",
        query=query, key=key, value=value, out=out, logsumexp=logsumexp, is_causal=is_causal,
        dropout_p=dropout_p, scale=scale)


_RING = {FORWARD: _ring_forward, BACKWARD: _ring_backward}


def _handler(op_call, args, kwargs):
    """torch's `_sdpa_handler`, step for step, with the CPU op's ring functions."""
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise AssertionError("context parallelism: q, k, v must arrive Shard(2)")
    local = _RING[op_call](op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
    return dispatcher.wrap(local, sharding.output_spec)


@contextlib.contextmanager
def cpu_ring_attention():
    """While active, `context_parallel` on CPU (real or fake tensors) runs torch's ring
    attention: the CPU op joins torch's `custom_ops` table (read when `context_parallel`
    enables its dispatcher) and its `Shard(2)` strategies are registered with torch's own
    `_op_strategy_context`, both undone on exit."""
    from torch.distributed.tensor.experimental._context_parallel import _attention
    from torch.distributed.tensor.experimental._context_parallel._sharding_rules import (
        _op_strategy_context)

    added = [op for op in _RING if op not in _attention.custom_ops]
    for op in added:
        _attention.custom_ops[op] = _handler
    try:
        with _op_strategy_context(FORWARD, _forward_strategy, None), \
                _op_strategy_context(BACKWARD, _backward_strategy, None):
            yield
    finally:
        for op in added:
            _attention.custom_ops.pop(op, None)

