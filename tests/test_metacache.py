"""Memoised meta kernels (hybridmem/trace/metacache.py) return what the kernel returns.

The oracle is the op's own meta kernel called directly on the same arguments: the replayed
output must have its shape, strides, dtype and storage size, and be a fresh storage; ops whose
outputs alias an input (views) and non-meta tensors are never recorded.
"""

from __future__ import annotations

import pytest
import torch

from hybridmem.trace import metacache

aten = torch.ops.aten


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


def _described(out):
    outs = out if isinstance(out, (list, tuple)) else [out]
    return [(tuple(t.shape), t.stride(), t.dtype, t.untyped_storage().nbytes()) for t in outs]


x = _meta(4, 8, 16)
CASES = {  # id: (op, args)
    "mul-broadcast-transposed": (aten.mul.Tensor, (x.transpose(0, 2), _meta(1, 8, 1))),
    "add-scalar-int-to-float": (aten.add.Tensor, (_meta(3, 5, dtype=torch.int64), 0.5)),
    "sum-dim-bf16": (aten.sum.dim_IntList, (_meta(4, 6, dtype=torch.bfloat16), [1])),
    "layer-norm-3-outputs": (aten.native_layer_norm.default,
                             (_meta(2, 7, 32), [32], _meta(32), _meta(32), 1e-5)),
    "cat": (aten.cat.default, ([_meta(2, 3), _meta(5, 3)],)),
    "foreach-sqrt-list": (aten._foreach_sqrt.default, ([_meta(3), _meta(4, 4)],)),
    "to-copy-permuted": (aten._to_copy.default, (x.permute(2, 0, 1),), {"dtype": torch.float16}),
}


@pytest.mark.parametrize("case", CASES)
def test_replay_equals_the_kernel(case):
    op, args, *kw = CASES[case]
    kwargs = kw[0] if kw else {}
    direct = _described(op(*args, **kwargs))
    first = metacache.call(op, args, kwargs)  # runs the kernel, records it
    again = metacache.call(op, args, kwargs)  # from the record
    assert _described(first) == direct and _described(again) == direct
    ins = {t.untyped_storage()._cdata for t in torch.utils._pytree.tree_leaves(args)
           if isinstance(t, torch.Tensor)}
    outs = again if isinstance(again, (list, tuple)) else [again]
    assert all(t.untyped_storage()._cdata not in ins for t in outs)  # fresh storages


def test_inplace_foreach_returns_nothing_and_changes_nothing():
    params = [_meta(3, 3), _meta(5)]
    for _ in range(2):  # record, then replay
        assert metacache.call(aten._foreach_add_.Scalar, (params, 1.0), {}) is None
    assert [tuple(p.shape) for p in params] == [(3, 3), (5,)]
    t = _meta(4)
    assert metacache.call(aten.add_.Tensor, (t, t), {}) is t
    assert metacache.call(aten.add_.Tensor, (t, t), {}) is t


def test_views_and_cpu_tensors_are_not_recorded():
    before = len(metacache._cache)
    base = _meta(4, 4)
    view = metacache.call(aten.t.default, (base,), {})
    assert view.untyped_storage()._cdata == base.untyped_storage()._cdata
    metacache.call(aten.mul.Tensor, (torch.ones(2), torch.ones(2)), {})  # a real CPU op
    assert len(metacache._cache) == before
