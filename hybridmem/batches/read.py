"""Per-sample token counts (and image counts) from a file: what `--lengths FILE` reads.

One integer per line (any extension but the table ones), or a table (parquet, JSONL / JSON
lines, CSV; read with pandas / pyarrow) with a column of token counts: `length` (Trainer's
`length_column_name` default), `num_tokens`, or `input_ids` (token lists, counted). An optional
image-count column (`num_images`, `images`: counts or lists, counted; `image`: LLaVA's data
JSON, one image where the field is set) prices VLM mixtures of text-only and image samples.

Any file, of any content, gives the counts or a one-line SpecError that names the file and
what is wrong, never the file's text (a message must not leak a file it was pointed at: binary,
`/proc/self/environ`); at most `MAX_SAMPLES` samples of at most `MAX_TOKENS` tokens are read.
`token_counts` parses the text of a lengths file given inline (the HTTP API's `lengths`).
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
MAX_SAMPLES = 1 << 24
"""Most samples a lengths file may list (16.8M): above the largest fine-tuning and preference
sets (~10**7 samples); a larger corpus is priced from a sample of its lengths (the run's
shapes follow the distribution, not the count)."""
MAX_TOKENS = 1 << 40
"""Most tokens one sample may count (a bound far above any `seq_len` cap, which truncates):
keeps every count within int64 and every line of digits short."""
MAX_LINE = len(str(MAX_TOKENS))
"""Digits of the longest count; a longer line is refused before int() parses it."""
MAX_TEXT_BYTES = MAX_SAMPLES * (MAX_LINE + 2)
"""Most bytes a one-integer-per-line file is read for (every line at `MAX_LINE` digits)."""
HINT = (f"one token count per line, or a parquet / jsonl / csv file with a column "
        f"{', '.join(LENGTH_COLUMNS)}")


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
    if not path.exists():
        raise SpecError("lengths", str(path), reason="no such file")
    if not path.is_file():
        raise SpecError("lengths", str(path), reason="not a regular file")
    kind = TABLES.get(path.suffix.lower())
    if kind is None:
        return Lengths(_lines(path), None, str(path))
    frame = read_table(path, kind)
    column = next((c for c in LENGTH_COLUMNS if c in frame.columns), None)
    if column is None:
        raise SpecError("lengths", str(path), LENGTH_COLUMNS,
                        reason=f"no token-count column among its {len(frame.columns)}")
    tokens = _counts(frame[column], f"{path}: {column}", minimum=1)
    image_col = next((c for c in IMAGE_COLUMNS if c in frame.columns), None)
    images = None
    if image_col == "image":  # LLaVA's data JSON: a path where the sample has an image
        images = frame[image_col].notna().to_numpy().astype(np.int64)
    elif image_col is not None:
        images = _counts(frame[image_col], f"{path}: {image_col}", minimum=0)
    return Lengths(tokens, images, f"{path}: {column}")


def read_table(path: Path, kind: str):
    import pandas as pd  # only for table files; a plain list of integers needs none

    try:
        if kind == "parquet":
            frame = pd.read_parquet(path)
        elif kind == "csv":
            frame = pd.read_csv(path)
        else:
            frame = pd.read_json(path, lines=True)
    except Exception as err:  # pandas / pyarrow raise many types for a malformed file
        # the parser's message may quote the file: only its kind is said
        raise SpecError("lengths", str(path), reason=f"cannot read it as {kind} "
                        f"({type(err).__name__})") from None
    if len(frame) == 0:
        raise SpecError("lengths", str(path), reason="has no rows")
    if len(frame) > MAX_SAMPLES:
        raise SpecError("lengths", str(path), reason=f"{len(frame)} rows, more than "
                        f"{MAX_SAMPLES}: price a sample of the lengths")
    return frame


def _lines(path: Path) -> np.ndarray:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_TEXT_BYTES + 1)
    except OSError as err:
        raise SpecError("lengths", str(path), reason=f"cannot read it ({err.strerror})") from None
    if len(data) > MAX_TEXT_BYTES:
        raise SpecError("lengths", str(path), reason=f"larger than {MAX_TEXT_BYTES} bytes: "
                        f"more than {MAX_SAMPLES} samples; price a sample of the lengths")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError("lengths", str(path), reason=f"not text (binary?): {HINT}") from None
    return token_counts(text, str(path))


def token_counts(text: str, where: str) -> np.ndarray:
    """The counts of a lengths file's `text` (one positive integer per line, blank lines
    skipped); a bad line is named by its number, never quoted."""
    values = []
    for number, line in enumerate(text.splitlines(), 1):
        value = line.strip()
        if not value:
            continue
        if not (value.isascii() and value.isdigit()) or len(value) > MAX_LINE \
                or not 1 <= int(value) <= MAX_TOKENS:
            raise SpecError("lengths", f"{where}:{number}", reason="not a token count from 1 "
                            f"to {MAX_TOKENS} ({HINT})")
        values.append(int(value))
        if len(values) > MAX_SAMPLES:
            raise SpecError("lengths", where, reason=f"more than {MAX_SAMPLES} samples; price "
                            "a sample of the lengths")
    if not values:
        raise SpecError("lengths", where, reason="has no token counts")
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
            row = next((i for i, v in enumerate(values) if not _whole(v)), 0)
            raise SpecError("lengths", where, reason=f"row {row + 1} is not a whole number")
        if values.dtype.kind == "f" and np.abs(values).max() > MAX_TOKENS:
            values = np.full(1, MAX_TOKENS + 1)  # refused below before the cast overflows
        out = values.astype(np.int64)
    if out.min() < minimum or out.max() > MAX_TOKENS:
        raise SpecError("lengths", where, reason=f"counts from {minimum} to {MAX_TOKENS}: "
                        f"{int(out.min())} to {int(out.max())}")
    return out


def _whole(value: object) -> bool:
    try:
        return float(value) == int(float(value))
    except (TypeError, ValueError):
        return False
