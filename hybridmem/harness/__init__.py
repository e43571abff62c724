"""`hybridmem collect`: sweeps of training configs, measured on CUDA (or run through a tier),
stored as a versioned parquet dataset that the learned tier reads with `load_dataset`."""

from hybridmem.harness.collect import BACKENDS, CollectReport, collect
from hybridmem.harness.schema import COLUMNS, HARNESS_VERSION, SCHEMA_VERSION
from hybridmem.harness.store import compact, load_dataset
from hybridmem.harness.sweep import Sweep, SweepItem, load_sweep

__all__ = ["BACKENDS", "COLUMNS", "HARNESS_VERSION", "SCHEMA_VERSION", "CollectReport", "Sweep",
           "SweepItem", "collect", "compact", "load_dataset", "load_sweep"]
