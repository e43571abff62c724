"""torch / CUDA version strings as the registry matches them. A module of its own so that
choosing a tier (`learned.predictor.default_method`, `learned.registry.select`) reads the
registry without importing the features (pandas)."""

from __future__ import annotations


def major_minor(text: object) -> str | None:
    """'2.13.0+cu124' -> '2.13'; None when it cannot be read."""
    parts = str(text or "").split("+")[0].split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and all(p.isdigit() for p in parts[:2]) else None
