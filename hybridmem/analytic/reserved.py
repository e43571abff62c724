"""Reserved - allocated bytes (fragmentation) from replaying `events.build`'s stream through
the trace tier's caching-allocator simulator.

Only the difference is taken from the replay: the allocated peak stays the closed form's
(the simulator's allocated peak differs slightly, e.g. it keeps <= 1 MiB remainders of split
blocks unsplit). The difference is `peak_reserved - peak_allocated` of the replay, the same
definition as the trace tier's `fragmentation` (`hybridmem.trace.estimate`).

Import cost: `hybridmem.trace/__init__` imports torch (via `trace.corrections`), so importing
`hybridmem.trace.allocator` would cost the analytic tier ~1 s and a torch dependency. The
simulator's two modules are pure Python; unless the trace package is already imported they
are loaded here from their files under private names (`_load`), the trace package untouched.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from functools import cache, lru_cache
from pathlib import Path

from hybridmem.errors import SpecError

_TRACE = "hybridmem.trace"
_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # AllocatorConfig.from_environ reads
_PRIVATE = "hybridmem.analytic._sim_"


@cache
def _load():
    """(AllocatorConfig, CachingAllocatorSim) without importing the torch-importing package."""
    if _TRACE in sys.modules:
        from hybridmem.trace.allocator_config import AllocatorConfig
        from hybridmem.trace.allocator_sim import CachingAllocatorSim
        return AllocatorConfig, CachingAllocatorSim
    root = Path(__file__).resolve().parent.parent / "trace"
    mods = {}
    for name in ("allocator_config", "allocator_sim"):
        spec = importlib.util.spec_from_file_location(_PRIVATE + name, root / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[_PRIVATE + name] = mod
        real = f"{_TRACE}.{name}"
        # allocator_sim imports `hybridmem.trace.allocator_config`: point that name at the
        # private copy while it runs (a module already in sys.modules is not re-imported, so
        # the package's __init__ does not run), then remove it again
        had = real in sys.modules
        if name == "allocator_sim" and not had:
            sys.modules[f"{_TRACE}.allocator_config"] = mods["allocator_config"]
        try:
            spec.loader.exec_module(mod)
        finally:
            if name == "allocator_sim" and not had:
                del sys.modules[f"{_TRACE}.allocator_config"]
        mods[name] = mod
    return mods["allocator_config"].AllocatorConfig, mods["allocator_sim"].CachingAllocatorSim


def config_from_environ(environ=None):
    """PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF (`AllocatorConfig.from_environ`)."""
    config, _ = _load()
    return config.from_environ(os.environ if environ is None else environ)


def fragmentation(events, config=None) -> tuple[int, int, int]:
    """(peak reserved - peak allocated, peak reserved, peak allocated) of the replayed stream.

    The loop is `hybridmem.trace.allocator_replay.replay` without its per-event timeline (which
    the analytic tier does not need and which costs time)."""
    _, sim_cls = _load()
    sim = sim_cls(config if config is not None else config_from_environ())
    live = {}
    malloc, free = sim.malloc, sim.free
    for action, key, size in events:
        if action == "alloc":
            live[key] = malloc(size, 0)
        else:
            free(live.pop(key))
    return sim.peak_reserved - sim.peak_allocated, sim.peak_reserved, sim.peak_allocated


def envelope(spec, stream: Callable) -> int:
    """Fragmentation for `spec`, made non-decreasing in the micro-batch.

    The replayed fragmentation F(b) is not monotone in the micro-batch b (segment reuse is
    discrete: llava-1.5-7b llm+projector ckpt gives 2.30, 2.10, 4.52, 9.39 GiB at b = 1, 2, 4,
    8), but `--find-max-batch` bisects on device bytes, which must not shrink as b grows. So
    the estimate is max F(2^j) over the powers of two 2^j <= b: exact at powers of two (if F
    grows there), non-decreasing in b, and log2(b) + 1 replays (each cached).
    `stream(spec)` returns the event stream of a spec."""
    env = tuple(os.environ.get(k) for k in _ENV)
    _config(env)  # a malformed PYTORCH_ALLOC_CONF raises its SpecError here
    best = 0
    for j in range(spec.micro_batch.bit_length()):
        try:
            smaller = spec.with_(micro_batch=1 << j)
        except SpecError:
            continue
        best = max(best, _replayed(smaller, stream, env))
    return best


def _config(env: tuple):
    config, _ = _load()
    return config.from_environ({k: v for k, v in zip(_ENV, env) if v is not None})


@lru_cache(maxsize=64)
def _replayed(spec, stream: Callable, env: tuple) -> int:
    return fragmentation(stream(spec), _config(env))[0]
