"""Memoised meta kernels: an op on the same tensor metadata makes the same output metadata.

Why: torch registers Python meta kernels over the C++ structured ones (torch/_meta_registrations.py
`activate_meta`, the `_refs`/`_decomp` Python decompositions, for symbolic shapes; `dispatch_dump`
lists the C++ one as "Meta (inactive)"). On concrete shapes they cost 150-250 us per elementwise op
(`mul` 255 us, `addcmul` 229 us, `native_layer_norm_backward` ~2 ms; C++ `mm` 32 us): most of the
meta trace's kernel time. A meta tensor has no data, so a kernel's output metadata is a function of
its inputs' metadata and its other arguments (and the default dtype, for Python-scalar promotion).
The first call runs the kernel and records the outputs; later calls with the same key get fresh
tensors of that metadata from `empty_strided` (C++), which is what the kernel would have returned.

Recorded only where replaying is exact, checked on the first call:
- functional ops (no alias annotation, Tensor / Tensor[] returns, not random): each output a fresh
  storage (no input's, no other output's), offset 0, as large as `empty_strided` makes it;
- in-place ops (the foreach optimizer steps): kernel changed no argument's metadata, returned
  nothing or one of its arguments, which the replay returns again; keyed also on which arguments
  share a storage.
Anything else (views, data-dependent or random ops, non-meta tensors: the fake and real backends)
runs its kernel every time.
"""

from __future__ import annotations

import torch

_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
            torch.memory_format)
_SKIP_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.dynamic_output_shape,
              torch.Tag.data_dependent_output)
_META = torch.device("meta")

_kinds: dict = {}  # op -> "functional" | "inplace" | None (never cached)
_cache: dict = {}  # key -> ("out", specs) | ("self", tensor position) | ("const", None or ())
_LIMIT = 200_000  # entries; cleared beyond (a bound, never reached by a 70B step: ~3k keys)


class _Uncacheable(Exception):
    pass


def _kind(func) -> str | None:
    kind = _kinds.get(func, False)
    if kind is not False:
        return kind
    schema = getattr(func, "_schema", None)
    kind = None
    if schema is not None and not any(t in func.tags for t in _SKIP_TAGS):
        returns = [str(r.type) for r in schema.returns]
        if all(r in ("Tensor", "List[Tensor]") for r in returns):
            aliased = any(a.alias_info is not None for a in schema.arguments) or any(
                r.alias_info is not None for r in schema.returns)
            if not schema.is_mutable and not aliased and returns:
                kind = "functional"
            elif schema.is_mutable and all(a.alias_info is None or a.alias_info.is_write
                                           for a in schema.arguments):
                kind = "inplace"
    _kinds[func] = kind
    return kind


def _key(x, tensors: list):
    """Hashable metadata of an argument; tensors (meta only) are collected in order."""
    kind = type(x)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        if not x.is_meta:
            raise _Uncacheable
        tensors.append(x)
        return (x.shape, x.stride(), x.dtype, x.storage_offset(), x.is_conj(), x.is_neg(),
                x.layout)
    if kind is list or kind is tuple or isinstance(x, tuple):  # torch.Size too
        return (kind, tuple([_key(y, tensors) for y in x]))
    if isinstance(x, _SCALARS):
        return (kind, x)
    raise _Uncacheable  # a tensor subclass (FakeTensor), a SymInt, an object


def _flat(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat(o)]
    raise _Uncacheable


def _fresh(spec) -> torch.Tensor:
    shape, stride, dtype = spec
    with torch._C.DisableTorchFunction():  # no torch-function mode sees the replay
        return torch.empty_strided(shape, stride, dtype=dtype, device=_META)


def _rebuild(func, specs):
    outs = []
    for ret in specs:
        outs.append([_fresh(s) for s in ret] if isinstance(ret, list) else _fresh(ret))
    return outs[0] if len(outs) == 1 else tuple(outs)


def _record_functional(func, out, tensors) -> tuple:
    inputs = {t.untyped_storage()._cdata for t in tensors}
    seen = set()
    specs = []
    returns = out if len(func._schema.returns) > 1 else (out,)
    for ret in returns:
        group = ret if isinstance(ret, (list, tuple)) else [ret]
        spec = []
        for t in group:
            if type(t) is not torch.Tensor or t.device != _META or t.storage_offset() or \
                    t.is_conj() or t.is_neg() or t.layout != torch.strided:
                raise _Uncacheable
            st = t.untyped_storage()
            if st._cdata in inputs or st._cdata in seen:
                raise _Uncacheable
            seen.add(st._cdata)
            s = (tuple(t.shape), t.stride(), t.dtype)
            if _fresh(s).untyped_storage().nbytes() != st.nbytes():
                raise _Uncacheable
            spec.append(s)
        specs.append(spec if isinstance(ret, (list, tuple)) else spec[0])
    return ("out", specs)


def _state(tensors) -> list:
    return [(t.shape, t.stride(), t.dtype, t.storage_offset(), t.untyped_storage().nbytes())
            for t in tensors]


def call(func, args, kwargs):
    """`func(*args, **kwargs)`, from the record of an earlier call with the same metadata where
    there is one (module docstring)."""
    kwargs = kwargs or {}
    kind = _kind(func)
    if kind is None:
        return func(*args, **kwargs)
    tensors: list = []
    try:
        key = (func, torch.get_default_dtype(), _key(args, tensors),
               tuple((k, _key(v, tensors)) for k, v in sorted(kwargs.items())))
        if kind == "inplace":
            storages = [t.untyped_storage()._cdata for t in tensors]
            key += (tuple(storages.index(s) for s in storages),)
    except _Uncacheable:
        return func(*args, **kwargs)
    hit = _cache.get(key)
    if hit is not None:
        if hit[0] == "out":
            return _rebuild(func, hit[1])
        return hit[1] if hit[0] == "const" else tensors[hit[1]]
    before = _state(tensors) if kind == "inplace" else None
    out = func(*args, **kwargs)
    try:
        if kind == "functional":
            entry = _record_functional(func, out, tensors)
        elif _state(tensors) != before:
            raise _Uncacheable
        elif out is None or (type(out) is tuple and not out):
            entry = ("const", out)
        else:
            entry = ("self", next(i for i, t in enumerate(tensors) if t is out))
    except (_Uncacheable, StopIteration):
        entry = None
    if entry is not None:
        if len(_cache) >= _LIMIT:
            _cache.clear()
        _cache[key] = entry
    return out
