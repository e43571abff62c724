"""The job's loop and technique fields that every measured row records and a sweep can vary.

Derived from the job schema: a field declared with `recorded=<pandas dtype>`
(`hybridmem.job.field.job_field`) is a dataset column (with the default older parts read back
with), a `hybridmem collect` sweep axis of the same name, and a `TrainingSpec` field passed
through unchanged; the columns come in the order the fields were added (`added=`), so the
dataset's column order never moves. `datasets/README.md` documents each column.
"""

from __future__ import annotations

from hybridmem.job.schema import recorded_fields as _recorded

RECORDED: dict[str, tuple[str, object]] = {m.name: (m.recorded, m.default) for m in _recorded()}
"""field: (pandas dtype of its column, default = the spec's default)."""
PARALLEL_RECORDED: frozenset[str] = frozenset(m.name for m in _recorded() if m.owner == "parallel")
"""The recorded fields that live on the spec's `ParallelSpec` (the model-parallel layout)."""

_CAST = {"string": str, "float64": float, "int64": int, "bool": bool,
         "Int64": lambda v: None if v is None else int(v)}


def recorded_values(spec) -> dict[str, object]:
    """The spec's value of every recorded field, as its column's type."""
    def holder(name: str):
        return spec.parallel if name in PARALLEL_RECORDED else spec
    return {name: _CAST[dtype](getattr(holder(name), name))
            for name, (dtype, _) in RECORDED.items()}


def recorded_fields(values: dict) -> dict[str, object]:
    """Spec keyword arguments from a sweep combination: whole numbers given to a float field
    become floats (a TOML `1` and `1.0` are one config, one `spec_hash`); nothing else is cast,
    so the spec's own checks still see what the file wrote."""
    out = {}
    for name, (dtype, _) in RECORDED.items():
        if name in PARALLEL_RECORDED:
            continue
        v = values[name]
        is_int = isinstance(v, int) and not isinstance(v, bool)
        out[name] = float(v) if dtype == "float64" and is_int else v
    return out


def recorded_parallel(values: dict) -> dict[str, object]:
    """`ParallelSpec` keyword arguments from a sweep combination: its recorded layout fields."""
    return {name: values[name] for name in RECORDED if name in PARALLEL_RECORDED}
