"""Test-wide isolation: MLflow store, config cache and plots go to temporary folders."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

# pytest-xdist (addopts `-n auto`): each worker gets its share of the CPUs for torch's and
# OpenMP's thread pools, which default to one thread per core: N workers each using every core
# would oversubscribe them. Set before any test imports torch.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _SHARE = str(max(1, len(os.sched_getaffinity(0)) // _WORKERS))
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, _SHARE)


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


@pytest.fixture
def stand_in_collect(tmp_path, monkeypatch):
    """`collect(axes)`: a one-block sweep over `llama-tiny` (seq 16, fp32, plus the TOML lines
    in `axes`) collected through the harness with the CPU stand-in probe; every row must be
    `ok`. Returns the dataset (the harness path of each technique, without a GPU)."""
    from hybridmem.harness import collect, load_dataset

    def run(axes: str):
        sweep = tmp_path / "s.toml"
        sweep.write_text('[[block]]\ndecoder = ["llama-tiny"]\nseq_len = [16]\n'
                         f'precision = ["fp32"]\n{axes.strip()}\n')
        monkeypatch.setenv("HYBRIDMEM_PROBE", "hybridmem.harness.probe:CpuProbe")
        out = tmp_path / "data"
        collect(sweep, out=out, backend="cuda", mlflow=False)
        df = load_dataset(out)
        assert set(df["outcome"]) == {"ok"}, df["error"].tolist()
        return df

    return run


@pytest.fixture
def stub_tier(monkeypatch):
    """Every tier answers 1 GiB at once: for tests of the front door (options, readers, echo),
    not of the pricing."""
    import importlib

    from hybridmem.categories import CATEGORIES
    from hybridmem.prediction import Peak, Prediction

    def stub(spec, **options):
        breakdown = dict.fromkeys(CATEGORIES, 0) | {"param": 2**30}
        peak = Peak(allocated_bytes=2**30, reserved_bytes=2**30, device_bytes=2**30,
                    phase="forward", iteration=0)
        return Prediction(model=spec.model, method="stub", params_total=1, params_trainable=1,
                          peak=peak, breakdown=breakdown, modules=())

    monkeypatch.setattr(importlib.import_module("hybridmem.predict"), "estimator",
                        lambda method: stub)
    return stub
