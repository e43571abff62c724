"""Test-wide isolation: MLflow store, config cache and plots go to temporary folders."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(autouse=True, scope="session")
def _isolated_stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybridmem-stores")
    old = {k: os.environ.get(k) for k in ("HYBRIDMEM_MLFLOW_URI", "HYBRIDMEM_CACHE")}
    os.environ["HYBRIDMEM_MLFLOW_URI"] = f"sqlite:///{root / 'mlruns' / 'mlflow.db'}"
    os.environ["HYBRIDMEM_CACHE"] = str(root / "cache")
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
