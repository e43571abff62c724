"""Learned tier on rows like the published benchmarks': one model, reserved figure only.

Rows come from `test_learned_support.make_rows` (made-up, labelled "analytic"); here their
device figure is blanked, as published rows have none, and all share one model shape.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from hybridmem.errors import SpecError
from hybridmem.learned import dataset, predictor, registry
from hybridmem.learned.accuracy import signed_errors, summary
from hybridmem.learned.features import build_table
from hybridmem.job.spec import TrainingSpec
from test_learned import FAST, _toy_base_and_registry  # noqa: F401 (autouse fixture)
from test_learned_support import make_rows, toy_base


def reserved_only_rows() -> pd.DataFrame:
    """One model shape, two experiments per spec (re-runs), device figure unmeasured."""
    rows = make_rows(shapes=((64, 2),))
    rows = pd.concat([rows, rows], ignore_index=True)
    rows["experiment"] = [f"exp-{i % 8}" for i in range(len(rows))]
    rows["model_type"] = "llava"  # the tiny-llava configs the rows are built on
    rows["peak_device_bytes"] = pd.array([None] * len(rows), dtype="Int64")
    return rows


def test_config_groups_join_rows_sharing_an_experiment_or_a_spec():
    rows = pd.DataFrame({"spec_hash": ["a", "a", "b", "c", "d"],
                         "experiment": ["x", "y", "y", "z", ""]})
    g = dataset.config_groups(rows)
    # a-x and a-y share the spec; a-y and b-y share the experiment: one component {a, b}
    assert g[0] == g[1] == g[2]
    assert len({g[0], g[3], g[4]}) == 3
    assert dataset.config_groups(rows.iloc[::-1].reset_index(drop=True))[::-1] == g  # order-free


def test_targets_are_the_figures_rows_measured():
    rows = reserved_only_rows()
    assert dataset.measured_targets(rows) == ("reserved",)
    assert len(dataset.usable_rows(rows, targets=("reserved",))) == len(rows)
    with pytest.raises(SpecError):
        dataset.usable_rows(rows)  # the default needs every target


def test_one_model_shape_is_cross_validated_by_configuration():
    rows = reserved_only_rows()
    table = build_table(dataset.usable_rows(rows, targets=("reserved",)))
    assert table.group_kind == "configuration"
    groups = table.groups
    # every spec hash lives in exactly one group: no config in train and test at once
    by_spec = pd.Series(groups).groupby(table.rows["spec_hash"].to_numpy()).nunique()
    assert (by_spec == 1).all()


def test_train_on_reserved_only_rows_and_predict_with_it(tmp_path):
    from hybridmem.learned.train import train

    rows = reserved_only_rows()
    path = tmp_path / "rows.parquet"
    rows.to_parquet(path)
    out = tmp_path / "registry" / "reserved-only"
    result = train(str(path), str(out), estimator_params=FAST, track=False)
    assert result.metadata["targets"] == ["reserved"]
    assert result.metadata["group_kind"] == "configuration"
    assert "reserved" in result.evaluations
    assert any("device peak" in n for n in result.notes)
    spec = TrainingSpec.from_dict({**json.loads(rows.iloc[0]["spec_json"]),
                                   "model": dataset_config(rows.iloc[0])})
    pred = predictor.estimate(spec, models_dir=tmp_path / "registry")
    base = toy_base(spec)
    # device = corrected reserved + the base's memory outside the allocator (context)
    outside = base.peak.device_bytes - base.peak.reserved_bytes
    assert pred.peak.device_bytes == pred.peak.reserved_bytes + outside
    assert pred.peak.reserved_bytes != base.peak.reserved_bytes
    assert any("reserved peak only" in n for n in pred.notes)
    assert any(n.startswith("nearest training row") for n in pred.notes)


def dataset_config(row) -> str:
    from hybridmem.models.loader import materialize_config

    return materialize_config(row["model_config"])


def test_nearest_names_the_fields_that_differ():
    near = predictor.nearest({"micro_batch": 8, "seq_len": 768, "train": "full"},
                             [{"label": "a", "micro_batch": 4, "seq_len": 768, "train": "lora"},
                              {"label": "b", "micro_batch": 4, "seq_len": 768, "train": "full"}])
    assert near == "nearest training row: b, 1 field(s) differ: micro_batch 4->8"
    assert predictor.nearest({"micro_batch": 4}, [{"label": "b", "micro_batch": 4}]).endswith(
        "same spec fields")


def test_a_spec_outside_the_model_domain_gets_the_analytic_estimate(tmp_path):
    from hybridmem.learned.train import train

    rows = reserved_only_rows()
    rows = rows[rows["precision"] == "fp32"]
    path = tmp_path / "rows.parquet"
    rows.to_parquet(path)
    train(str(path), str(tmp_path / "registry" / "m"), estimator_params=FAST, track=False)
    spec = TrainingSpec.from_dict({**json.loads(rows.iloc[0]["spec_json"]),
                                   "model": dataset_config(rows.iloc[0]),
                                   "precision": "bf16-mixed"})
    pred = predictor.estimate(spec, models_dir=tmp_path / "registry")
    assert pred.peak == toy_base(spec).peak
    assert any("does not apply" in n and "precision=bf16-mixed" in n for n in pred.notes)


def test_default_method_does_not_refuse_a_torch_outside_the_trained(tmp_path, monkeypatch):
    from hybridmem.learned.train import train

    rows = make_rows(source="analytic", torch_version="2.9.0")
    rows["source"] = "cuda"  # the selection rule only; no measured number is read here
    path = tmp_path / "rows.parquet"
    rows.to_parquet(path)
    train(str(path), str(tmp_path / "registry" / "m"), estimator_params=FAST, track=False)
    monkeypatch.setenv("HYBRIDMEM_TORCH_VERSION", "2.9.1")
    assert predictor.default_method(tmp_path / "registry") == "hybrid"
    # another minor version: the per-group trust decides inside the hybrid tier
    monkeypatch.setenv("HYBRIDMEM_TORCH_VERSION", "2.13.0")
    assert predictor.default_method(tmp_path / "registry") == "hybrid"
    # another major version: no model is compatible
    monkeypatch.setenv("HYBRIDMEM_TORCH_VERSION", "3.0.0")
    assert predictor.default_method(tmp_path / "registry") == "analytic"


def test_signed_error_summary_by_hand():
    err = signed_errors([90, 103, 110, np.nan], [100, 100, 100, 100])
    assert np.allclose(err[:3], [-10, 3, 10]) and np.isnan(err[3])
    s = summary(err)
    assert s["n"] == 3 and s["median_ape"] == 10 and s["median_signed"] == 3
    assert s["under_share"] == pytest.approx(1 / 3) and s["within_3pct"] == pytest.approx(1 / 3)
    assert s["max_ape"] == 10


def test_a_model_family_the_residual_never_saw_is_outside_its_domain(tmp_path):
    from hybridmem.learned.train import train

    rows = reserved_only_rows()  # tiny-llava configs: model_type llava
    path = tmp_path / "rows.parquet"
    rows.to_parquet(path)
    train(str(path), str(tmp_path / "registry" / "m"), estimator_params=FAST, track=False)
    spec = TrainingSpec(model="tiny-llama", micro_batch=1, seq_len=128)  # model_type llama
    pred = predictor.estimate(spec, models_dir=tmp_path / "registry")
    assert pred.peak == toy_base(spec).peak
    assert any("does not apply" in n and "model_type=llama (trained: llava)" in n
               for n in pred.notes)


def test_a_dora_config_the_trace_tier_prices_is_still_grouped_as_dora():
    from hybridmem.adapters import job_group, spec_fields

    # rank_pattern: no closed form, so train='peft'; the method is still DoRA
    fields = spec_fields({"peft_type": "LORA", "use_dora": True, "target_modules": ["q_proj"],
                          "rank_pattern": {"q_proj": 4}})
    spec = TrainingSpec(model="tiny-llama", **fields)
    assert spec.train == "peft" and job_group(spec) == "dora"
