"""FSDP2's gathered params and gradient buffers at each point of a rank's timeline.

Why per point: what FSDP2 holds depends on which unit (a `fully_shard`-ed decoder layer, or
the root: embedding, final norm, `lm_head`) is running, and the activations peak where little
is gathered (the loss). One constant added at every point (`sharding.fsdp`'s `gathered` and
`comm`) prices the worst unit's buffers beside the loss's activations, which never coexist.

What FSDP2 keeps, frees and prefetches (torch 2.13
`torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`, `_fsdp_state.py`), the same
Python on CPU and CUDA (its streams only choose the caching allocator's pool; every lifetime
is a Python reference, never `record_stream`):

- forward: `pre_forward` all-gathers the unit into one flat buffer (`foreach_all_gather`; the
  input is a view into it) and copies it out into the unsharded params (`wait_for_unshard`),
  keeping the flat buffer in `comm_ctx.all_gather_state` until the next unit's
  `wait_for_unshard` frees it ([Note: Overlapping all-gather copy-in and all-gather]);
  `post_forward` reshards (frees the unsharded params), except the root, which stays
  unsharded (`_lazy_init`: no `post_forward_mesh_info`); the root's `_post_forward` flushes
  the last flat buffer. So: the root's step before the first unit holds root + its flat
  buffer, a unit holds root + the unit + its flat buffer, the root's steps after the last unit
  root + the last unit's flat buffer.
- backward: a unit's `pre_backward` (its hook sits on the unit's outputs, so it fires after
  the final norm's backward) all-gathers it, frees the flat buffer at once, and
  `_backward_prefetch` all-gathers the previous unit (its flat buffer, copied out at that
  unit's own `pre_backward`): the loss, `lm_head` and norm backward hold the root alone; a unit
  holds root + the unit + the previous unit's flat buffer. `post_backward` reduce-scatters the
  unit's unsharded grads through an input buffer in `reduce_dtype` that stays alive until the
  next unit's `post_backward` (`reduce_scatter_states`, `reduce_scatter_max_input_buffers =
  1`); the unit's grads are then its shard. The root's grads stay unsharded until the root's
  own `post_backward`, at the end of the backward.

The timeline's grads are the narrow model's, unsharded; a finished unit's are replaced by
its shard here. `reshard_after_forward=False` keeps every unit unsharded from its forward to
its backward: the constant of `sharding.fsdp` is already that case, and is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybridmem.parallel.sharding import fsdp_shard
from hybridmem.parallel.states import ModelTensors


@dataclass(frozen=True, slots=True)
class Units:
    """A rank's FSDP2 units, in its steps' order."""

    of_step: tuple[str, ...]
    """Each timeline step's unit: a decoder layer's name, or "root"."""
    gathered: dict[str, int]
    """Unit -> bytes of its unsharded params (= its flat all-gather buffer): `n` padded shards
    (`FSDPParam._init_sharded_param`) in the gather dtype."""
    shard_grad: dict[str, int]
    """Unit -> bytes of its sharded grads (the params' own dtype)."""
    reduce_input: dict[str, int]
    """Unit -> bytes of its reduce-scatter input (`reduce_dtype`)."""
    inner: dict[str, int] = field(default_factory=dict)
    """Unit -> bytes of the unsharded params of the unit nested in it (a MoE layer's experts,
    `fully_shard`ed over their own mesh, `with_inner`); empty without one."""
    inner_flat: dict[str, int] = field(default_factory=dict)
    """Unit -> bytes of its nested unit's flat all-gather buffer: none on a mesh of one rank
    (`FSDPParamGroup.unshard` / `wait_for_unshard` with `world_size == 1`: the unsharded
    params are copied from the shards, no all-gather output is kept)."""


def units(mt: ModelTensors, of_step: tuple[str, ...], n: int, gather_bytes: int,
          reduce_bytes: int, param_bytes) -> Units:
    """`param_bytes(tensor)`: bytes per element of its sharded param (and grad)."""
    gathered: dict[str, int] = {}
    grads: dict[str, int] = {}
    reduce: dict[str, int] = {}
    for t in mt.tensors:
        k = fsdp_shard(t, n)
        gathered[t.unit] = gathered.get(t.unit, 0) + n * k * gather_bytes
        if t.trainable:
            grads[t.unit] = grads.get(t.unit, 0) + k * param_bytes(t)
            reduce[t.unit] = reduce.get(t.unit, 0) + n * k * reduce_bytes
    return Units(of_step, gathered, grads, reduce)


def with_inner(outer: Units, nested: Units, nested_ranks: int) -> Units:
    """`outer`'s units, each holding the unit nested in it (`nested`, on the same steps):
    torchtitan's `apply_fsdp` with ep `fully_shard`s each layer's experts over `dp_shard x
    cp / ep` before the layer over `dp_shard x cp`, so each is a unit of its own. Its grads
    reach their shard with their layer's (its `post_backward` runs first); its reduce-scatter
    input is freed at the layer's own `post_backward` (`reduce_scatter_max_input_buffers =
    1`), so the reduce input kept past a layer is the layer's."""
    grads = {u: outer.shard_grad.get(u, 0) + nested.shard_grad.get(u, 0)
             for u in {*outer.shard_grad, *nested.shard_grad}}
    inner = {u: b for u, b in nested.gathered.items() if u != "root"}
    return replace(outer, shard_grad=grads, inner=inner,
                   inner_flat=inner if nested_ranks > 1 else {})


def at_point(u: Units, phase: str, step: int, grad: int, step_grads: list[int]) -> tuple[int, int]:
    """(gathered param bytes, grad bytes) at a forward/backward point of step `step` whose
    timeline grads (unsharded) are `grad`; `step_grads[i]`: grads step i makes."""
    of = u.of_step
    root = u.gathered.get("root", 0)
    layers = [i for i, name in enumerate(of) if name != "root"]
    if not layers or step < 0:
        return root, grad
    first, last = layers[0], layers[-1]
    name = of[step]
    inner = u.inner.get(name, 0)
    if phase == "forward":
        if name != "root":
            # the layer's flat buffer lives until the nested unit's copy-out
            # (`wait_for_unshard` frees `comm_ctx.all_gather_state`), whose own flat buffer
            # then lives until the next unit's
            nested = inner + u.inner_flat.get(name, 0)
            return root + u.gathered[name] + max(u.gathered[name], nested), grad
        # before the first unit: the root's own flat buffer; after the last: the last unit's
        return root + (u.gathered["root"] if step < first else u.gathered[of[last]]), grad
    # backward: the units after `step` are done; their grads are shards now
    done = [i for i in layers if i > step]
    grad += sum(u.shard_grad.get(of[i], 0) - step_grads[i] for i in done)
    if done:  # the reduce-scatter input of the unit finished last waits for the next one's
        grad += u.reduce_input.get(of[min(done)], 0)
    if name == "root":
        return root, grad
    # a nested unit's `pre_backward` prefetches the previous layer (the unit before it in
    # `post_forward_order`), while the layer itself prefetches only its nested unit, which is
    # copied out at once: the nested unit's backward holds both of the layer's and the
    # previous layer's flat buffer
    earlier = [i for i in layers if i < step]
    prefetched = u.gathered[of[max(earlier)]] if earlier else 0
    return root + u.gathered[name] + inner + prefetched, grad
