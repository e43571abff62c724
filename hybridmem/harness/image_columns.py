"""The dataset's two image-size columns: `image_size` (height) and `image_width`.

Why two int columns and not one text column: `image_size` was an int64 column before `HxW`
sizes existed (a square's side), and old part files, the learned tier's column contract
(`learned/dataset.py`) and every reader keep reading it as an int. A non-square size (the
spec's "HxW", `job/images.normalize_image_size`) is recorded as its height in `image_size` and
its width in the added `image_width`; a part written before `image_width` existed reads back
with the width of a square (= `image_size`), so old rows mean what they meant. The spec itself,
and so `spec_hash` and the store's dedup keys, travel in `spec_json` unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from hybridmem.job.images import parse_image_size

DERIVED_COLUMNS: dict[str, str] = {"image_width": "image_size"}
"""Columns added later whose missing value is another column's (a square's width = its side)."""


def image_columns(image_size: object) -> dict[str, int]:
    """The row's columns for a spec's `image_size` (None, an int or "HxW"): 0s without images."""
    hw = parse_image_size(image_size)
    height, width = hw if hw is not None else (0, 0)
    return {"image_size": height, "image_width": width}


def fill_derived(frame: pd.DataFrame | Mapping, column: str) -> object:
    """`column` of `frame` (a frame or one row) with missing values taken from its source."""
    source = DERIVED_COLUMNS[column]
    if isinstance(frame, pd.DataFrame):
        if column not in frame:
            return frame[source]
        return frame[column].fillna(frame[source])
    value = frame.get(column)
    return frame.get(source) if value is None or pd.isna(value) else value
