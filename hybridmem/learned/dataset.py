"""Reading the collect dataset: the columns the learned tier relies on, checked at the boundary.

The column contract is agreed with `hybridmem collect` (the writer documents the full schema in
`datasets/README.md`); only the columns read here are required. A missing or mistyped column,
or an empty dataset, is a one-line `SpecError` naming it, raised before anything is written.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pandas as pd

from hybridmem.errors import SpecError
# the contract's source/outcome values (owned by the harness); only REAL_SOURCES rows ("cuda":
# collect's, "published": imported real-GPU runs) are GPU measurements
from hybridmem.harness.schema import OUTCOMES, REAL_SOURCES, SOURCES  # noqa: F401 (train.py reads it)

# Kinds: "int" integer (nullable allowed), "num" int or float (targets: nullable int64 may come
# back as float when a reader fills nulls), "str" text, "bool" boolean.
REQUIRED_COLUMNS: dict[str, str] = {
    "schema_version": "int",
    "spec_hash": "str",
    "source": "str",
    "outcome": "str",
    "spec_json": "str",
    "model_config": "str",
    "model_name": "str",
    "micro_batch": "int",
    "seq_len": "int",
    "images_per_sample": "int",
    "image_size": "int",
    "precision": "str",
    "optimizer": "str",
    "train": "str",
    "attn": "str",
    "grad_ckpt": "bool",
    "lora_r": "int",
    "world_size": "int",
    "peak_allocated_bytes": "num",
    "peak_reserved_bytes": "num",
    "peak_device_bytes": "num",
    "gpu_name": "str",
    "gpu_memory_bytes": "int",
    "cuda_version": "str",
    "torch_version": "str",
    "transformers_version": "str",
}


SCHEMA_VERSION = 1
"""Newest dataset schema this reader understands (`hybridmem.harness.schema.SCHEMA_VERSION`)."""

TARGET_COLUMNS: dict[str, str] = {"device": "peak_device_bytes", "reserved": "peak_reserved_bytes"}
"""Target name (CLI `--target`) -> measured column."""

_KIND_CHECKS = {
    "int": (pd.api.types.is_integer_dtype, "integer"),
    "num": (lambda s: pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s),
            "number"),
    "bool": (pd.api.types.is_bool_dtype, "boolean"),
    "str": (lambda s: pd.api.types.is_string_dtype(s) or pd.api.types.is_object_dtype(s), "text"),
}


def load(path: str | Path) -> pd.DataFrame:
    """Rows of a dataset (a parquet file or a folder of them), validated."""
    p = Path(path)
    if not p.exists():
        raise SpecError("data", str(path), reason="no such file or folder")
    try:  # the writer's own reader (newest row per measurement key), when present
        from hybridmem.harness.store import load_dataset
    except ImportError:
        load_dataset = None
    try:
        try:
            df = load_dataset(p) if load_dataset is not None else pd.read_parquet(p)
        except KeyError:  # the writer's reader needs its key columns; `validate` names them
            df = pd.read_parquet(p)
    except SpecError:
        raise
    except Exception as err:  # pyarrow raises several types for unreadable files
        raise SpecError("data", str(path), reason=f"not a readable parquet dataset ({err})") from None
    return validate(df, str(path))


def validate(df: pd.DataFrame, name: str = "dataset") -> pd.DataFrame:
    """`df` unchanged if it has every required column with the right kind and >= 1 row."""
    for column, kind in REQUIRED_COLUMNS.items():
        if column not in df.columns:
            raise SpecError("dataset column", column, reason=f"missing in {name}")
        check, word = _KIND_CHECKS[kind]
        series = df[column]
        if kind == "str" and len(series.dropna()) and not all(isinstance(v, str) for v in series.dropna()):
            raise SpecError("dataset column", column,
                            reason=f"expected text, got {series.dtype} in {name}")
        if not check(series):
            raise SpecError("dataset column", column,
                            reason=f"expected {word}, got {series.dtype} in {name}")
    if df.empty:
        raise SpecError("data", name, reason="the dataset has no rows")
    newest = int(df["schema_version"].max())
    if newest > SCHEMA_VERSION:
        raise SpecError("dataset column schema_version", newest,
                        reason=f"newer than this reader ({SCHEMA_VERSION}); upgrade hybridmem")
    bad = sorted(set(df["source"]) - set(SOURCES))
    if bad:
        raise SpecError("dataset column source", bad[0], SOURCES)
    bad = sorted(set(df["outcome"]) - set(OUTCOMES))
    if bad:
        raise SpecError("dataset column outcome", bad[0], OUTCOMES)
    return df


def measured_targets(df: pd.DataFrame) -> tuple[str, ...]:
    """The targets (`TARGET_COLUMNS` keys) that some ok row of `df` measured.

    A published row may carry only the reserved peak (the caching allocator's figure, no
    nvidia-smi reading): a model trained on such rows has a reserved residual only."""
    ok = df[df["outcome"] == "ok"]
    return tuple(t for t, col in TARGET_COLUMNS.items()
                 if col in ok and (pd.to_numeric(ok[col], errors="coerce") > 0).any())


def usable_rows(df: pd.DataFrame, sources: tuple[str, ...] | None = None,
                targets: tuple[str, ...] | None = None) -> pd.DataFrame:
    """Rows with a measured peak (outcome ok, `targets` present, default all), optionally of
    some sources.

    OOM, error and excluded rows carry no usable peak; they are kept out of fitting (see
    `evaluate` for OOMs). `targets` (names of `TARGET_COLUMNS`) asks only for those peaks:
    published rows have a reserved peak but no device or allocated one (null).
    """
    columns = [TARGET_COLUMNS[t] for t in (targets or TARGET_COLUMNS)]
    keep = (df["outcome"] == "ok") & df[columns].notna().all(axis=1)
    for col in columns:
        keep &= pd.to_numeric(df[col], errors="coerce") > 0
    if sources is not None:
        keep &= df["source"].isin(sources)
    out = df[keep].reset_index(drop=True)
    if out.empty:
        raise SpecError("data", f"{len(df)} rows", reason="no row with outcome 'ok' and a measured peak"
                        + (f" among sources {list(sources)}" if sources else ""))
    return out


def oom_rows(df: pd.DataFrame, sources: tuple[str, ...]) -> pd.DataFrame:
    """Rows that ran out of memory (no peak, but a verdict: it did not fit its GPU)."""
    return df[(df["outcome"] == "oom") & df["source"].isin(sources)].reset_index(drop=True)


def dataset_hash(df: pd.DataFrame) -> str:
    """sha256 of the rows' content (order- and file-layout-independent), for provenance."""
    cols = sorted(REQUIRED_COLUMNS)
    ordered = df[cols].astype(str).sort_values(cols, kind="stable").reset_index(drop=True)
    digest = hashlib.sha256()
    digest.update(",".join(cols).encode())
    digest.update(pd.util.hash_pandas_object(ordered, index=False).values.tobytes())
    return digest.hexdigest()


def config_groups(rows: pd.DataFrame) -> list[str]:
    """One group per configuration for cross-validation, when every row has the same model.

    Rows are joined when they share an `experiment` (a published experiment re-run on another
    torch or date) or a `spec_hash` (the same job under two experiment names): the connected
    components, so one config is never in the training and the test fold at once."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    experiments = rows["experiment"] if "experiment" in rows else pd.Series([""] * len(rows))
    keys = []
    for spec, exp in zip(rows["spec_hash"].astype(str), experiments.fillna("").astype(str)):
        a = find("s:" + spec)
        if exp:
            b = find("e:" + exp)
            parent[b] = a
        keys.append("s:" + spec)
    roots = {k: find(k) for k in keys}
    # a component is named by its smallest spec hash: stable for the same rows in any order
    names: dict[str, str] = {}
    for k in keys:
        names[roots[k]] = min(names.get(roots[k], k), k)
    return ["config-" + hashlib.sha256(names[roots[k]].encode()).hexdigest()[:12] for k in keys]


def shape_group(model_config: str) -> str:
    """Group key for cross-validation: one per model architecture / size (hash of its config)."""
    import json

    data = {k: v for k, v in json.loads(model_config).items() if not k.startswith("_")}
    canonical = json.dumps(data, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]
