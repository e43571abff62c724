"""The dataset on disk: a folder of parquet part files, written atomically, read as one table.

Each measured config becomes its own part file, written to a hidden temporary name, flushed,
and renamed into place (`os.replace` is atomic on POSIX), so a killed run leaves only whole
files. `compact` merges parts into one file the same way. Readers keep, per `spec_hash` and
environment key, the newest row, so a crash between writing a merged file and deleting the
parts it replaces never shows a row twice.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from hybridmem.errors import SpecError
from hybridmem.harness.image_columns import DERIVED_COLUMNS, fill_derived
from hybridmem.harness.schema import ADDED_COLUMNS, COLUMNS, ENV_KEY, IDENTITY, SCHEMA_VERSION

PART_PREFIX = "part-"
KEY: tuple[str, ...] = ("spec_hash",) + ENV_KEY
DEDUP_KEY: tuple[str, ...] = KEY + IDENTITY
"""What the reader keeps one (the newest) row of: `KEY` plus an imported row's own id."""


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def rows_frame(rows: Iterable[Mapping]) -> pd.DataFrame:
    """Rows as a frame with exactly the schema's columns and dtypes (missing -> null; a
    column added later, `ADDED_COLUMNS`, missing from a row -> its default, as on reading;
    a `DERIVED_COLUMNS` one -> its source column's value)."""
    rows = list(rows)
    for row in rows:
        extra = set(row) - set(COLUMNS)
        assert not extra, f"columns outside the schema: {sorted(extra)}"
    df = pd.DataFrame({c: [fill_derived(row, c) if c in DERIVED_COLUMNS else
                           row.get(c, ADDED_COLUMNS.get(c)) for row in rows] for c in COLUMNS})
    return df.astype(COLUMNS)


def _write_atomic(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    df.to_parquet(tmp, index=False)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _part_name(tag: str) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    return f"{PART_PREFIX}{stamp}-{tag}-{uuid.uuid4().hex[:8]}.parquet"


def append_rows(root: str | Path, rows: Iterable[Mapping]) -> Path:
    """Write `rows` as one new part file of the dataset at `root` (created if missing)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    df = rows_frame(rows)
    tag = df["spec_hash"].iloc[0][:12] if len(df) == 1 else f"n{len(df)}"
    path = root / _part_name(tag)
    _write_atomic(df, path)
    return path


def part_files(path: str | Path) -> list[Path]:
    """The dataset's whole part files (temporary files of a running writer are ignored)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        return []
    return sorted(f for f in p.glob(f"{PART_PREFIX}*.parquet") if f.is_file())


def _read(files: list[Path]) -> pd.DataFrame:
    frames = []
    for f in files:
        try:
            frames.append(pd.read_parquet(f))
        except Exception as err:  # pyarrow raises several types for unreadable files
            raise SpecError("dataset", str(f), reason=f"unreadable parquet part ({err})") from None
    if not frames:
        return rows_frame([])
    df = pd.concat(frames, ignore_index=True)
    for column in DERIVED_COLUMNS:  # parts written before it: from its source column
        df[column] = fill_derived(df, column).astype(COLUMNS[column])
    for column, default in ADDED_COLUMNS.items():  # parts written before the column existed
        if column not in df:
            df[column] = default
        if default is not None:
            df[column] = df[column].fillna(default)
        df[column] = df[column].astype(COLUMNS[column])
    newer = df["schema_version"] > SCHEMA_VERSION
    if newer.any():
        raise SpecError("schema_version", int(df.loc[newer, "schema_version"].max()),
                        reason=f"written by a newer harness; this one reads <= {SCHEMA_VERSION}")
    return df


def _newest(df: pd.DataFrame) -> pd.DataFrame:
    df = df.sort_values("collected_at", kind="stable")
    return df.drop_duplicates(list(DEDUP_KEY), keep="last").reset_index(drop=True)


def load_dataset(path: str | Path) -> pd.DataFrame:
    """All rows of a dataset (folder of parts or one parquet file), newest per key, in order.

    Only `source` in `REAL_SOURCES` ("cuda", "published", "user") rows are measurements; the others
    are tier predictions.
    """
    p = Path(path)
    if not p.exists():
        raise SpecError("dataset", str(path), reason="no such file or folder")
    return _newest(_read(part_files(p)))


def measured_keys(path: str | Path) -> set[tuple]:
    """(spec_hash, gpu_name, torch_version, source) of every row already in the dataset."""
    if not Path(path).exists():
        return set()
    df = _read(part_files(path))
    return set(map(tuple, df[list(KEY)].itertuples(index=False)))


def compact(path: str | Path) -> Path | None:
    """Merge the dataset's parts into one file (atomically), then remove the merged parts.

    Parts written by another writer meanwhile are left alone.
    """
    files = part_files(path)
    if len(files) < 2 or not Path(path).is_dir():
        return None
    df = _newest(_read(files)).reindex(columns=list(COLUMNS)).astype(COLUMNS)
    merged = Path(path) / _part_name(f"n{len(df)}")
    _write_atomic(df, merged)
    for f in files:
        f.unlink(missing_ok=True)
    return merged
