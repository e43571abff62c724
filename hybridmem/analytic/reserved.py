"""Reserved - allocated bytes (fragmentation) from replaying `events.build`'s stream through
the caching-allocator simulator (`hybridmem.allocator`, shared with the trace tier).

Only the difference is taken from the replay: the allocated peak stays the closed form's
(the simulator's allocated peak differs slightly, e.g. it keeps <= 1 MiB remainders of split
blocks unsplit). The difference is `peak_reserved - peak_allocated` of the replay, the same
definition as the trace tier's `fragmentation` (`hybridmem.trace.estimate`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from hybridmem.allocator.config import AllocatorConfig, alloc_conf_string
from hybridmem.allocator.replay import replay
from hybridmem.errors import SpecError

# CARRY = 1 / CARRY_DIV: how much of a smaller micro-batch's device bytes carries over to a
# larger one's, per byte of allocated growth. 1 would carry its whole fragmentation (always
# conservative), 0 assumes the larger batch's new tensors fit in the smaller one's spare
# segments (device bytes then stop growing with the batch). Neither is measured; 1/2 is the
# midpoint, and on the large configs of experiments/analytic_vs_trace.py the estimate equals
# the replay at the spec's own micro-batch.
CARRY_DIV = 2


def fragmentation(events, config=None) -> tuple[int, int, int]:
    """(peak reserved - peak allocated, peak reserved, peak allocated) of the replayed stream
    (`hybridmem.allocator.replay`). `config`: by default the one PYTORCH_ALLOC_CONF /
    PYTORCH_CUDA_ALLOC_CONF give (`AllocatorConfig.from_environ`)."""
    result = replay(events, config if config is not None else AllocatorConfig.from_environ())
    return (result.peak_reserved - result.peak_allocated, result.peak_reserved,
            result.peak_allocated)


def envelope(spec, allocated: int, measure: Callable) -> int:
    """Fragmentation for `spec`, such that device bytes never shrink as the micro-batch grows.

    The replayed fragmentation F(b) is not monotone in the micro-batch b, and neither is the
    trace tier's (segment reuse is discrete: llava-1.5-7b bf16 flash-attention gives 5.6, 1.6,
    11.4, 1.5 GiB at b = 1..4; the trace tier 3.6, 1.9, 12.3, 2.2 GiB), but `--find-max-batch`
    bisects on device bytes (and they should grow with it). With D(p) = allocated(p) + F(p)
    and q the largest power of two <= b, the estimate of reserved bytes is
        max( max over powers of two p <= q of D(p) + CARRY * (allocated(b) - allocated(p)),
             allocated(b) + min(F(q), F(2q)) )
    Non-decreasing in b (strictly where allocated grows): within [q, 2q) both terms grow
    with allocated(b); at b = 2q the first term gains D(2q) = allocated(2q) + F(2q), which
    bounds every earlier second term. At a power of two it is D(b) unless a smaller power had
    more device bytes (then about that, as find-max-batch needs). Cost: log2(b) + 1 replays,
    + 1 when b is not a power of two; each is cached.
    `measure(spec)` returns (closed-form allocated peak, event stream) of a spec."""
    env = alloc_conf_string()  # the cache key: AllocatorConfig itself may not hash
    _config(env)  # a malformed PYTORCH_ALLOC_CONF raises its SpecError here
    b = spec.micro_batch
    q = 1 << (b.bit_length() - 1)
    device = allocated
    for j in range(q.bit_length()):
        a, f = _at(spec, 1 << j, measure, env)
        if a:
            device = max(device, a + f + (allocated - a) // CARRY_DIV)
    if b != q:
        f_q = _at(spec, q, measure, env)[1]
        f_2q = _at(spec, 2 * q, measure, env, default=f_q)[1]
        device = max(device, allocated + min(f_q, f_2q))
    return device - allocated


def _at(spec, batch: int, measure: Callable, env: str, default: int = 0) -> tuple[int, int]:
    """(allocated, F) at another micro-batch; a batch the spec rejects counts as (0, default)."""
    try:
        other = spec.with_(micro_batch=batch)
    except SpecError:
        return 0, default
    return _replayed(other, measure, env)


def _config(env: str) -> AllocatorConfig:
    return AllocatorConfig.from_env(env)


@lru_cache(maxsize=64)
def _replayed(spec, measure: Callable, env: str) -> tuple[int, int]:
    allocated, events = measure(spec)
    return allocated, fragmentation(events, _config(env))[0]
