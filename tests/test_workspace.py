"""The cuBLAS workspace follows the GPU's compute capability, as PyTorch chooses it.

Rule (PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp `parseChosenWorkspaceSize`): with
CUBLAS_WORKSPACE_CONFIG unset, ":4096:2:16:8" (2 x 4096 KiB + 8 x 16 KiB) except 4096 KiB x 8 on
Hopper (compute capability 9.x); CUBLAS_WORKSPACE_CONFIG=":SIZE:COUNT..." sums SIZE KiB x COUNT.
The expected sizes below are written out from that rule by hand, not taken from the code.
"""

from __future__ import annotations

import pytest

from hybridmem.analytic import estimate as analytic
from hybridmem.allocator.overheads import (
    CUBLAS_HANDLES_TRAINING,
    cublas_workspace,
    parse_workspace_config,
)
from hybridmem.gpus import ARCH_BY_CAPABILITY, GPUS, custom_gpu, gpu_by_name
from hybridmem.predict import predict
from hybridmem.job.spec import TrainingSpec

KiB = 1024
AMPERE = 2 * 4096 * KiB + 8 * 16 * KiB   # ":4096:2:16:8" = 8,519,680 bytes
HOPPER = 8 * 4096 * KiB                  # ":4096:8" = 32 MiB


def _spec(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": "tiny-llama", "micro_batch": 2, "seq_len": 64, **kw})


def test_every_catalogued_gpu_has_the_family_of_its_compute_capability():
    for gpu in GPUS.values():
        assert gpu.compute_capability is not None, gpu.name
        assert gpu.arch == ARCH_BY_CAPABILITY[gpu.compute_capability], gpu.name


@pytest.mark.parametrize("name,expected", [("a100-40gb", AMPERE), ("l40s", AMPERE),
                                           ("t4", AMPERE), ("h100-80gb", HOPPER),
                                           ("h200", HOPPER)])
def test_default_workspace_by_compute_capability(name, expected, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert cublas_workspace(gpu_by_name(name)) == expected


def test_no_gpu_or_unknown_capability_keeps_hoppers_size(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert cublas_workspace(None) == HOPPER
    assert cublas_workspace(custom_gpu(24)) == HOPPER


@pytest.mark.parametrize("value,expected", [
    (":4096:8", HOPPER), (":4096:2:16:8", AMPERE), (":16:8", 8 * 16 * KiB),
    ("garbage", AMPERE),  # PyTorch warns and uses its default
])
def test_cublas_workspace_config_overrides_the_default(value, expected):
    a100 = gpu_by_name("a100-40gb")
    assert cublas_workspace(a100, {"CUBLAS_WORKSPACE_CONFIG": value}) == expected
    assert parse_workspace_config(None, 123) == 123


def test_a100_prediction_prices_amperes_workspace_in_both_tiers(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    spec, a100 = _spec(), gpu_by_name("a100-40gb")
    for method in ("analytic", "trace"):
        base = predict(spec, method=method)
        on_a100 = predict(spec, method=method, gpu=a100)
        assert base.breakdown["workspace"] == CUBLAS_HANDLES_TRAINING * HOPPER, method
        assert on_a100.breakdown["workspace"] == CUBLAS_HANDLES_TRAINING * AMPERE, method
        # the workspaces are alive at the peak: allocated drops by exactly the difference
        assert (base.peak.allocated_bytes - on_a100.peak.allocated_bytes
                == CUBLAS_HANDLES_TRAINING * (HOPPER - AMPERE)), method


def test_the_analytic_note_names_the_gpu_and_without_one_keeps_todays_line(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    notes = analytic(_spec(), gpu=gpu_by_name("a100-40gb")).notes
    assert any("8519680 bytes each (a100-40gb, sm_80" in n for n in notes)
    assert ("workspace: two cuBLAS workspaces of Hopper size (32 MiB each); other GPUs use less"
            in analytic(_spec()).notes)


def test_find_max_batch_probes_price_the_gpus_workspace(monkeypatch):
    """Every probe of the micro-batch search is told the GPU too (not only the asked spec)."""
    import sys

    P = sys.modules["hybridmem.predict"]  # the package re-exports the function under that name

    seen = []
    real = P.estimator

    def spy(method):
        run = real(method)
        return lambda spec, **kw: (seen.append(kw.get("gpu")), run(spec, **kw))[1]

    monkeypatch.setattr(P, "estimator", spy)
    a100 = gpu_by_name("a100-40gb")
    predict(_spec(), gpu=a100, find_max_batch=True)
    assert len(seen) > 2 and all(g is a100 for g in seen)
