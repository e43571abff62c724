"""Each dataset row's spec priced by a tier, once per distinct spec, cached on disk.

Evaluation against real rows needs every tier's answer for every row's spec. The analytic tier
takes milliseconds; the trace tier takes seconds per 3B-parameter step, so its answers are kept
in a parquet cache keyed by (spec_hash, method, code fingerprint): the fingerprint is a hash of
the tiers' source files, so a change to any tier re-prices instead of serving stale numbers.
A spec a tier cannot price gets NaN peaks and the one-line reason.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pandas as pd

from hybridmem.errors import SpecError

# the packages whose code decides a tier's answer (a change to any of them re-prices)
TIER_PACKAGES: tuple[str, ...] = ("analytic", "trace", "allocator", "models", "parallel", "job",
                                 "families")
FIGURES: tuple[str, ...] = ("allocated", "reserved", "device", "after_step")
"""Per-spec figures: the three peaks and the allocated bytes right after the optimizer step
(`Prediction.extras["after_step_allocated_bytes"]`, the published benchmarks' steady state)."""


FLUSH_EVERY = 5
"""Specs priced between cache writes: a killed evaluation keeps what it already priced."""


def fingerprint() -> str:
    """sha256 (12 hex digits) of the tier packages' source, plus the top-level modules they use."""
    root = Path(__file__).resolve().parents[1]
    files = sorted(p for pkg in TIER_PACKAGES for p in (root / pkg).rglob("*.py"))
    files += sorted(root.glob("*.py"))
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _price(spec, method: str) -> dict:
    from hybridmem.predict import predict

    try:
        pred = predict(spec, method=method)
    except SpecError as err:
        return {"error": str(err)[:300]}
    return {"allocated": pred.peak.allocated_bytes, "reserved": pred.peak.reserved_bytes,
            "device": pred.peak.device_bytes,
            "after_step": pred.extras.get("after_step_allocated_bytes"), "error": ""}


def _read(path: Path) -> pd.DataFrame:
    try:
        return pd.read_parquet(path)
    except (OSError, ValueError):  # missing or unreadable cache: start afresh
        return pd.DataFrame(columns=["key", *FIGURES, "error"])


def _write(path: Path, df: pd.DataFrame) -> None:
    """Atomic replace, so a killed evaluation never leaves a half-written cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    df.to_parquet(tmp, index=False)
    os.replace(tmp, path)


def tier_rows(rows: pd.DataFrame, method: str, *, use_cache: bool = True,
              progress=None) -> pd.DataFrame:
    """One line per row of `rows` (same order): `FIGURES` in bytes (NaN where the tier cannot
    price the spec) and `error` (why not). The trace tier's answers are cached."""
    from hybridmem.harness.schema import spec_from_row

    from hybridmem.models.loader import cache_root

    cache = cache_root() / "tiers" / f"{method}.parquet"
    stamp = fingerprint()
    known = _read(cache) if use_cache and method != "analytic" else pd.DataFrame(
        columns=["key", *FIGURES, "error"])
    seen = {k: r for k, r in zip(known["key"], known.to_dict("records"))}
    fresh = []
    out = []
    distinct = list(dict.fromkeys(rows["spec_hash"].astype(str)))
    for i, spec_hash in enumerate(distinct):
        key = f"{spec_hash}:{method}:{stamp}"
        if key not in seen:
            row = rows[rows["spec_hash"].astype(str) == spec_hash].iloc[0]
            if progress is not None:
                progress(i + 1, len(distinct), str(row.get("model_name", "")))
            try:
                priced = _price(spec_from_row(row), method)
            except (SpecError, ValueError, KeyError, TypeError) as err:
                priced = {"error": f"unreadable spec ({type(err).__name__}: {err})"[:300]}
            seen[key] = {"key": key, **{f: priced.get(f) for f in FIGURES},
                         "error": priced["error"]}
            fresh.append(seen[key])
            if use_cache and method != "analytic" and len(fresh) % FLUSH_EVERY == 0:
                _write(cache, pd.concat([known, pd.DataFrame(fresh)], ignore_index=True))
    if fresh and use_cache and method != "analytic":
        _write(cache, pd.concat([known, pd.DataFrame(fresh)], ignore_index=True))
    for spec_hash in rows["spec_hash"].astype(str):
        out.append(seen[f"{spec_hash}:{method}:{stamp}"])
    df = pd.DataFrame(out).drop(columns=["key"])
    for f in FIGURES:
        df[f] = pd.to_numeric(df[f], errors="coerce").astype(float)
    df["error"] = df["error"].fillna("").astype(str)
    return df.reset_index(drop=True)


def nan_rows(n: int) -> pd.DataFrame:
    """A `tier_rows` frame of `n` rows the tier did not price."""
    return pd.DataFrame({**{f: np.full(n, np.nan) for f in FIGURES}, "error": [""] * n})
