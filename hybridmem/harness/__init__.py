"""`hybridmem collect`: sweeps of training configs, measured on CUDA (or run through a tier),
stored as a versioned parquet dataset that the learned tier reads with `load_dataset`.

Names are imported on first use (PEP 562) so that registering the CLI command does not pull
in pandas and pyarrow for every `hybridmem predict`.
"""

from importlib import import_module

_EXPORTS: dict[str, str] = {
    "BACKENDS": "collection", "CollectReport": "collection", "collect": "collection",
    "COLUMNS": "schema", "HARNESS_VERSION": "schema", "SCHEMA_VERSION": "schema",
    "compact": "store", "load_dataset": "store",
    "Sweep": "sweep", "SweepItem": "sweep", "load_sweep": "sweep",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hybridmem.harness' has no attribute {name!r}")
    value = getattr(import_module(f"hybridmem.harness.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups skip this hook
    return value
