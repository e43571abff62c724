"""Per-rank memory under data parallelism (DDP, ZeRO-1/2/3, FSDP2) around any tier (the
training configs users already have are read by `hybridmem.intake`).

The package imports nothing eagerly (importing torch-heavy estimators for a name lookup would be
slow); the public names are resolved on first use.
"""

from importlib import import_module

_EXPORTS = {
    "estimate_per_rank": "estimate", "smallest_fitting_setup": "fit",
    "ParallelSpec": "hybridmem.job.parallel",
    "STRATEGIES": "hybridmem.job.parallel", "check_parallel": "validate",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(name)
    module = _EXPORTS[name]
    return getattr(import_module(module if "." in module else f"hybridmem.parallel.{module}"), name)
