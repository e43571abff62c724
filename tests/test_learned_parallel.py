"""The learned tier prices a multi-GPU spec on one path: the per-rank analytic base.

A training row of a multi-GPU job and the same job asked about with `predict --method hybrid`
must be featurised from the same base (the per-rank estimate `predict --method analytic` serves),
or `hybridmem evaluate` scores a different path than `predict` serves. The residual
model here is a stand-in that records what it is asked and predicts no correction, so the served
peak must be exactly that per-rank base.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from hybridmem.learned import registry
from hybridmem.learned.features import build_table
from hybridmem.models.loader import load_config_dict
from hybridmem.job.parallel import ParallelSpec
from hybridmem.predict import estimator, predict
from hybridmem.job.spec import TrainingSpec
from test_learned_support import trusted_everywhere

GPU = "NVIDIA H100 80GB HBM3"
TORCH = "2.13.0"


class Recorder:
    """A fitted-residual stand-in: log-residual 0 (no correction), remembers its inputs."""

    def __init__(self) -> None:
        self.seen: list[pd.DataFrame] = []

    def predict(self, X: pd.DataFrame) -> np.ndarray:
        self.seen.append(X.copy())
        return np.zeros(len(X))

    predict_upper = predict


def training_row(spec: TrainingSpec) -> dict:
    """`spec` as a dataset row (the contract in datasets/README.md; made-up peaks, never read
    by the features)."""
    _, cfg = load_config_dict(spec.model)
    cfg = {k: v for k, v in cfg.items() if k != "_source"}
    return {"spec_hash": "multi-gpu", "spec_json": json.dumps(spec.to_dict()),
            "model_config": json.dumps(cfg, sort_keys=True), "model_name": "tiny-llava",
            "source": "cuda", "outcome": "ok", "peak_device_bytes": 1, "peak_reserved_bytes": 1,
            "gpu_name": GPU, "gpu_memory_bytes": 80 * 2**30, "torch_version": TORCH,
            "cuda_version": "", "alloc_conf": ""}


@pytest.fixture
def recorder(monkeypatch, tmp_path) -> Recorder:
    rec = Recorder()
    model = registry.LoadedModel(
        name="recorder", path=tmp_path, estimators={"device": rec, "reserved": rec},
        metadata={"gpu_names": [GPU], "gpu_memory_bytes": 80 * 2**30, "calibrated_to_gpu": True,
                  "torch_versions": [TORCH], "cuda_versions": [""],
                  "trust": trusted_everywhere(["device", "reserved"])})
    monkeypatch.setenv("HYBRIDMEM_TORCH_VERSION", TORCH)
    monkeypatch.setenv("HYBRIDMEM_CUDA_VERSION", "")
    monkeypatch.setattr("hybridmem.learned.registry.select", lambda *a: (tmp_path, []))
    monkeypatch.setattr("hybridmem.learned.predictor.load_cached", lambda folder: model)
    monkeypatch.setattr("hybridmem.learned.registry.read_metadata", lambda folder: model.metadata)
    return rec


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "fsdp"])
def test_multi_gpu_features_at_predict_time_equal_the_training_rows(recorder, strategy):
    spec = TrainingSpec(model="tiny-llava", micro_batch=2, seq_len=128,
                        parallel=ParallelSpec(world_size=4, strategy=strategy))
    table = build_table(pd.DataFrame([training_row(spec)]))
    served = predict(spec.with_(model=_materialised(table.rows)), method="hybrid")
    asked = recorder.seen[0].iloc[0].to_dict()
    trained = table.X.iloc[0].to_dict()
    assert asked.keys() == trained.keys()
    differ = {k: (asked[k], trained[k]) for k in trained
              if not (asked[k] == trained[k] or (pd.isna(asked[k]) and pd.isna(trained[k])))}
    assert differ == {}
    # the base of both is the per-rank estimate `predict --method analytic` serves, not the
    # unsharded single-GPU one, and with no correction that is what hybrid serves
    per_rank = estimator("analytic")(spec)
    single = estimator("analytic")(spec.with_(parallel=ParallelSpec()))
    assert trained["world_size"] == 4 and trained["strategy"] == strategy
    assert trained["base_device_gib"] == per_rank.peak.device_bytes / 2**30
    assert per_rank.peak.device_bytes != single.peak.device_bytes
    assert served.peak.device_bytes == per_rank.peak.device_bytes
    assert served.method == "hybrid" and served.extras["per_rank"] is True


def _materialised(rows: pd.DataFrame) -> str:
    """The model path a dataset row's spec is rebuilt with (`harness.schema.spec_from_row`)."""
    from hybridmem.models.loader import materialize_config

    return materialize_config(rows.iloc[0]["model_config"])
