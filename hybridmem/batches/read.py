"""Per-sample token counts (and image counts) from a file: what `--lengths FILE` reads.

One integer per line (any extension but the table ones), or a table (parquet, JSONL / JSON
lines, CSV; read with pandas / pyarrow) with a column of token counts: `length` (Trainer's
`length_column_name` default), `num_tokens`, or `input_ids` (token lists, counted). An optional
image-count column (`num_images`, `images`: counts or lists, counted; `image`: LLaVA's data
JSON, one image where the field is set) prices VLM mixtures of text-only and image samples.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridmem.errors import SpecError

LENGTH_COLUMNS: tuple[str, ...] = ("length", "num_tokens", "input_ids")
"""Token-count columns, in the order they are looked for."""
IMAGE_COLUMNS: tuple[str, ...] = ("num_images", "images", "image")
"""Image-count columns, in the order they are looked for."""
TABLES: dict[str, str] = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl",
                          ".csv": "csv"}
"""Extension -> table format; any other file is one integer per line."""


@dataclass(frozen=True)
class Lengths:
    """What a lengths file says, one entry per sample, in dataset order."""

    tokens: np.ndarray
    """Tokens per sample (int64, >= 1), image tokens included as `seq_len` counts them."""
    images: np.ndarray | None
    """Images per sample (int64, >= 0), or None: the job's `images_per_sample` for all."""
    source: str
    """Where they came from: "FILE" or "FILE: column"."""

    def __len__(self) -> int:
        return len(self.tokens)


def read_lengths(path: str | os.PathLike) -> Lengths:
    """The file's per-sample counts; a bad file is a one-line SpecError naming it."""
    path = Path(path)
    if not path.is_file():
        raise SpecError("lengths", str(path), reason="no such file")
    kind = TABLES.get(path.suffix.lower())
    if kind is None:
        return Lengths(_lines(path), None, str(path))
    frame = _table(path, kind)
    column = next((c for c in LENGTH_COLUMNS if c in frame.columns), None)
    if column is None:
        raise SpecError("lengths", str(path), LENGTH_COLUMNS,
                        reason=f"no token-count column among {list(map(str, frame.columns))[:8]}")
    tokens = _counts(frame[column], f"{path}: {column}", minimum=1)
    image_col = next((c for c in IMAGE_COLUMNS if c in frame.columns), None)
    images = None
    if image_col == "image":  # LLaVA's data JSON: a path where the sample has an image
        images = frame[image_col].notna().to_numpy().astype(np.int64)
    elif image_col is not None:
        images = _counts(frame[image_col], f"{path}: {image_col}", minimum=0)
    return Lengths(tokens, images, f"{path}: {column}")


def _table(path: Path, kind: str):
    import pandas as pd  # only for table files; a plain list of integers needs none

    try:
        if kind == "parquet":
            frame = pd.read_parquet(path)
        elif kind == "csv":
            frame = pd.read_csv(path)
        else:
            frame = pd.read_json(path, lines=True)
    except Exception as err:  # pandas / pyarrow raise many types for a malformed file
        raise SpecError("lengths", str(path), reason=f"cannot read it as {kind}: "
                        f"{str(err).splitlines()[0][:120] if str(err) else type(err).__name__}"
                        ) from None
    if len(frame) == 0:
        raise SpecError("lengths", str(path), reason="has no rows")
    return frame


def _lines(path: Path) -> np.ndarray:
    values = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if not text:
            continue
        if not (text.isascii() and text.isdigit()) or int(text) < 1:
            raise SpecError("lengths", f"{path}:{number}", reason=f"{text[:40]!r} is not a "
                            "positive integer (one token count per line, or a parquet / jsonl "
                            f"/ csv file with a column {', '.join(LENGTH_COLUMNS)})")
        values.append(int(text))
    if not values:
        raise SpecError("lengths", str(path), reason="has no token counts")
    return np.asarray(values, dtype=np.int64)


def _counts(column, where: str, minimum: int) -> np.ndarray:
    """A column of counts, or of lists (counted), as int64; anything else names the column."""
    first = column.iloc[0]
    if isinstance(first, (list, tuple, np.ndarray)):
        try:
            out = column.map(len).to_numpy(dtype=np.int64)
        except TypeError:
            raise SpecError("lengths", where, reason="mixes lists and non-lists") from None
    else:
        values = column.to_numpy()
        if values.dtype.kind not in "iu" and not (
                values.dtype.kind == "f" and np.all(np.isfinite(values))
                and np.all(values == np.round(values))):
            bad = next((v for v in values if not _whole(v)), values[0])
            raise SpecError("lengths", where, reason=f"{bad!r} is not a whole number")
        out = values.astype(np.int64)
    if out.min() < minimum:
        raise SpecError("lengths", where, reason=f"{int(out.min())} is below {minimum}")
    return out


def _whole(value: object) -> bool:
    try:
        return float(value) == int(float(value))
    except (TypeError, ValueError):
        return False
