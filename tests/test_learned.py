"""Learned residual tier: dataset checks, metrics, estimator, registry, train, predictor.

Rows come from `test_learned_support.make_rows` (made-up, labelled "analytic", never "cuda");
the base estimate is its `toy_base`, patched in where the analytic tier would be used.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from hybridmem.errors import SpecError
from hybridmem.learned import dataset, registry
from hybridmem.learned.features import build_table, feature_row
from hybridmem.learned.metrics import error_metrics, verdict_accuracy
from hybridmem.job.spec import TrainingSpec
from test_learned_support import SHAPES, make_rows, toy_base, true_factor, trusted_everywhere

FAST = {"n_estimators": 60}
"""Fewer boosting rounds keep each fit ~20 ms; enough for the learnable made-up factor."""


@pytest.fixture
def rows() -> pd.DataFrame:
    return make_rows()


@pytest.fixture
def data_file(rows, tmp_path) -> str:
    path = tmp_path / "rows.parquet"
    rows.to_parquet(path)
    return str(path)


@pytest.fixture(autouse=True)
def _toy_base_and_registry(monkeypatch, tmp_path):
    monkeypatch.setattr("hybridmem.learned.features.analytic_base", toy_base)
    monkeypatch.setenv("HYBRIDMEM_MODELS", str(tmp_path / "registry"))
    monkeypatch.setenv("HYBRIDMEM_TORCH_VERSION", "2.13.0")
    monkeypatch.delenv("HYBRIDMEM_CUDA_VERSION", raising=False)


# ---- dataset boundary ----

def test_missing_column_names_it(rows):
    with pytest.raises(SpecError, match=r"dataset column='peak_device_bytes': missing"):
        dataset.validate(rows.drop(columns=["peak_device_bytes"]))


def test_mistyped_column_names_it(rows):
    rows["micro_batch"] = rows["micro_batch"].astype(str)
    with pytest.raises(SpecError, match=r"dataset column='micro_batch': expected integer"):
        dataset.validate(rows)


def test_empty_dataset_is_an_error(rows):
    with pytest.raises(SpecError, match="no rows"):
        dataset.validate(rows.iloc[:0])


def test_unknown_source_and_newer_schema_are_errors(rows):
    bad = rows.assign(source="synthetic")
    with pytest.raises(SpecError, match="source.*valid: cuda, published, user, trace, analytic"):
        dataset.validate(bad)
    with pytest.raises(SpecError, match="schema_version.*newer"):
        dataset.validate(rows.assign(schema_version=99))


def test_usable_rows_drop_oom_rows(rows):
    rows.loc[0, "outcome"] = "oom"
    rows.loc[0, "peak_device_bytes"] = pd.NA
    assert len(dataset.usable_rows(rows)) == len(rows) - 1


def test_dataset_hash_ignores_row_order(rows):
    assert dataset.dataset_hash(rows) == dataset.dataset_hash(rows.iloc[::-1])
    changed = rows.copy()
    changed.loc[3, "peak_device_bytes"] += 1
    assert dataset.dataset_hash(rows) != dataset.dataset_hash(changed)


# ---- features and metrics ----

def test_features_cover_spec_base_and_environment():
    spec = TrainingSpec(model="tiny-llava", micro_batch=2, seq_len=64)
    from hybridmem.models.loader import load_config_dict

    row = feature_row(spec, load_config_dict("tiny-llava")[1], toy_base(spec),
                      {"gpu_name": "h100", "gpu_memory_bytes": 2**30, "torch_version": "2.13.0+cu126",
                       "cuda_version": "12.6"})
    # tiny-llava: CLIP 30 px / 6 px patches -> 5 x 5 = 25 image tokens per image (preset _source)
    assert row["image_tokens"] == 25
    assert row["torch"] == pytest.approx(2.13) and row["cuda"] == pytest.approx(12.06)
    for cat in ("param", "grad", "optimizer", "activation", "temporary", "workspace",
                "context", "fragmentation"):
        assert f"base_{cat}_gib" in row and f"share_{cat}" in row


def test_error_metrics_hand_computed():
    # predicted 110 and 90 against 100: APE 10 % each, one under-prediction of two.
    m = error_metrics([110, 90], [100, 100])
    assert m["mape"] == pytest.approx(10) and m["under_share"] == 0.5
    # verdicts at capacities 90, 95, 105, 110 (truth: no, no, yes, yes):
    # predicted 110 -> no, no, no, yes: 3 right; predicted 90 -> yes, yes, yes, yes: 2 right
    assert verdict_accuracy(np.array([110.0, 90.0]), np.array([100.0, 100.0])) == 5 / 8


# ---- estimator ----

def test_estimator_follows_sklearn_conventions_and_learns(rows, tmp_path):
    from sklearn.utils.validation import check_is_fitted

    from hybridmem.learned.model import ResidualRegressor

    table = build_table(rows, toy_base)
    y = table.target("device")
    est = ResidualRegressor(**FAST)
    assert est.fit(table.X, y, groups=table.rows["model_config"]) is est
    check_is_fitted(est)
    specs = [TrainingSpec.from_dict({**json.loads(s), "model": "tiny-llava"}) for s in table.rows["spec_json"]]
    truth = np.log([true_factor(s) for s in specs])
    assert np.abs(est.predict(table.X) - truth).max() < 0.03  # noise sd 0.005 in make_rows
    assert np.all(est.predict_upper(table.X) >= est.predict(table.X))
    est.save(tmp_path, "device")
    again = ResidualRegressor.load(tmp_path, "device")
    np.testing.assert_allclose(again.predict(table.X), est.predict(table.X))
    np.testing.assert_allclose(again.predict_upper(table.X), est.predict_upper(table.X))


def test_fit_rejects_bad_targets(rows):
    from hybridmem.learned.model import ResidualRegressor

    table = build_table(rows, toy_base)
    with pytest.raises(SpecError, match="finite"):
        ResidualRegressor(**FAST).fit(table.X, np.full(len(table.X), np.inf))


# ---- train, registry, predictor ----

def _train(data_file, out, **kw):
    from hybridmem.learned.train import train

    return train(data_file, out, estimator_params=FAST, n_splits=3, **kw)


def test_train_writes_registry_entry_and_mlflow_run(data_file, tmp_path):
    import mlflow

    out = tmp_path / "registry" / "toy"
    result = _train(data_file, out)
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["calibrated_to_gpu"] is False and meta["sources"] == ["analytic"]
    assert meta["format_version"] == registry.FORMAT_VERSION
    assert meta["dataset"]["rows"] == len(SHAPES) * 8 and len(meta["training_groups"]) == len(SHAPES)
    assert meta["feature_ranges"]["seq_len"] == [128, 256]
    assert {p.name for p in out.iterdir()} >= {"metadata.json", "device.point.txt", "device.upper.txt",
                                               "reserved.point.txt", "reserved.json"}
    # held-out shapes: the made-up factor is learnable, so the hybrid must beat the base
    cv = result.evaluations["device"].table
    assert cv["hybrid"]["mape"] < cv["analytic"]["mape"] / 3
    run = mlflow.get_run(meta["mlflow_run_id"])
    assert run.data.tags["calibrated_to_gpu"] == "false"
    assert run.data.params["dataset_hash"] == meta["dataset"]["hash"]
    assert "device_cv_hybrid_mape" in run.data.metrics
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "device_hybrid_mape")
    assert sorted(m.step for m in history) == [0, 1, 2]
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert {"feature_importances.json", "predicted_vs_measured.png", "model"} <= artifacts


def test_train_refuses_to_overwrite_and_bad_data_changes_nothing(data_file, rows, tmp_path):
    out = tmp_path / "registry" / "toy"
    _train(data_file, out)
    before = (out / "metadata.json").read_text()
    with pytest.raises(SpecError, match="already exists; pass --force"):
        _train(data_file, out)
    bad = tmp_path / "bad.parquet"
    rows.drop(columns=["seq_len"]).to_parquet(bad)
    with pytest.raises(SpecError, match="seq_len"):
        _train(str(bad), out, force=True)
    assert (out / "metadata.json").read_text() == before
    assert [p.name for p in out.parent.iterdir()] == ["toy"]  # no temp folders left


def test_incompatible_format_version_is_a_clear_error(data_file, tmp_path):
    out = tmp_path / "registry" / "toy"
    _train(data_file, out)
    meta = json.loads((out / "metadata.json").read_text())
    (out / "metadata.json").write_text(json.dumps({**meta, "format_version": 0}))
    with pytest.raises(SpecError, match="format_version 0 is incompatible"):
        registry.load(out)
    folder, notes = registry.select(out.parent, "2.13.0", None)
    assert folder is None and any("incompatible" in n for n in notes)


def _fake_entry(root, name, torch_versions, created, calibrated=False):
    (root / name).mkdir(parents=True)
    (root / name / "metadata.json").write_text(json.dumps({
        "format_version": registry.FORMAT_VERSION, "torch_versions": torch_versions,
        "cuda_versions": ["12.4"], "created_at": created, "calibrated_to_gpu": calibrated}))


def test_select_prefers_matching_torch_then_newest(tmp_path):
    _fake_entry(tmp_path, "old", ["2.13.0"], "2026-01-01")
    _fake_entry(tmp_path, "new", ["2.13.1"], "2026-06-01")
    _fake_entry(tmp_path, "other", ["2.12.0"], "2026-09-01")
    assert registry.select(tmp_path, "2.13.0", "12.4")[0].name == "new"
    folder, notes = registry.select(tmp_path, "2.14.0", "12.4")
    assert folder.name == "other" and any("outside the torch versions" in n for n in notes)
    assert registry.select(tmp_path, "3.0.0", None)[0] is None
    assert registry.select(tmp_path, "2.13.0", "11.8")[0] is None  # CUDA major differs


def test_hybrid_falls_back_to_analytic_when_no_model():
    from hybridmem.learned.predictor import estimate

    spec = TrainingSpec(model="tiny-llava", micro_batch=2, seq_len=64)
    pred = estimate(spec)
    assert pred.peak == toy_base(spec).peak and pred.extras["residual_model"] is None
    assert any("no trained residual model applies" in n for n in pred.notes)


def test_hybrid_applies_model_and_warns(data_file, tmp_path):
    from hybridmem.learned.predictor import estimate

    _train(data_file, tmp_path / "registry" / "toy")
    spec = TrainingSpec(model="tiny-llava", micro_batch=2, seq_len=200, precision="fp32")
    base = toy_base(spec)
    pred = estimate(spec)
    assert pred.method == "hybrid" and pred.extras["residual_model"] == "toy"
    assert pred.to_dict()["residual_model"] == "toy"  # extras reach the --json object
    # the made-up factor for fp32 without checkpointing is 1.25 (test_learned_support.true_factor)
    assert pred.peak.device_bytes / base.peak.device_bytes == pytest.approx(1.25, rel=0.05)
    assert pred.extras["upper_bound_bytes"] >= pred.peak.device_bytes
    assert sum(pred.breakdown.values()) == pred.peak.device_bytes
    assert pred.breakdown["param"] == base.breakdown["param"]
    assert any("NOT calibrated to real GPUs" in n for n in pred.notes)
    far = estimate(spec.with_(seq_len=4096))
    assert any("outside the model's training range" in n and "seq_len=4096" in n for n in far.notes)


def test_default_method_needs_a_gpu_calibrated_model(data_file, tmp_path):
    from hybridmem.learned.predictor import default_method

    assert default_method() == "analytic"  # empty registry
    out = tmp_path / "registry" / "toy"
    _train(data_file, out)
    assert default_method() == "analytic"  # trained on non-cuda rows: never the default
    meta = json.loads((out / "metadata.json").read_text())
    (out / "metadata.json").write_text(json.dumps({**meta, "calibrated_to_gpu": True}))
    assert default_method() == "hybrid"


def test_trace_baseline_joins_trace_rows_by_spec_but_never_a_row_to_itself(rows):
    from hybridmem.learned.evaluate import trace_baseline
    from hybridmem.learned.train import pick_sources

    trace = rows.iloc[:3].assign(source="trace", peak_device_bytes=[11, 22, 33])
    both = pd.concat([rows, trace], ignore_index=True)
    values = trace_baseline(both, both, "device")
    assert list(values[:3]) == [11, 22, 33] and np.isnan(values[3:len(rows)]).all()
    assert np.isnan(values[len(rows):]).all()  # trace rows themselves
    assert pick_sources(both) == ("trace",)  # sources are never mixed


def test_corrupt_model_file_and_single_target_models(data_file, tmp_path):
    from hybridmem.learned.predictor import estimate

    out = tmp_path / "registry" / "dev"
    _train(data_file, out, target="reserved")
    assert json.loads((out / "metadata.json").read_text())["targets"] == ["reserved"]
    spec = TrainingSpec(model="tiny-llava", micro_batch=2, seq_len=200, precision="fp32")
    pred = estimate(spec)
    assert pred.extras["residual_model"] == "dev"
    assert pred.peak.reserved_bytes / toy_base(spec).peak.reserved_bytes == pytest.approx(1.25, rel=0.05)
    (out / "reserved.point.txt").write_text("not a model")
    with pytest.raises(SpecError, match="cannot load the 'reserved' model"):
        registry.load(out)
    meta = (out / "metadata.json")
    meta.write_text(meta.read_text() + " ")  # new mtime: the predictor's cache reloads
    pred = estimate(spec)  # predict does not crash on a damaged entry: it falls back, saying so
    assert pred.extras["residual_model"] is None
    assert any("could not be loaded" in n for n in pred.notes)


def test_oom_rows_are_judged_at_their_real_gpu_limit(rows, tmp_path):
    from hybridmem.learned.compare import compare

    # made-up OOM rows: fp32 specs (made-up factor 1.25) on a GPU 1.15 x the base estimate:
    # the base says "fits" (wrong), a residual that learned the factor says "does not fit"
    fp32 = rows[(rows["precision"] == "fp32") & ~rows["grad_ckpt"]].copy()
    base = fp32["peak_device_bytes"].astype(float) / 1.25
    oom = fp32.assign(outcome="oom", spec_hash=fp32["spec_hash"] + "-oom", peak_device_bytes=pd.NA, peak_reserved_bytes=pd.NA,
                      peak_allocated_bytes=pd.NA, gpu_memory_bytes=(base * 1.15).astype("int64"))
    path = tmp_path / "with-oom.parquet"
    pd.concat([rows, oom], ignore_index=True).to_parquet(path)
    result = compare(path, n_splits=3, estimator_params=FAST)
    assert result.table["hybrid"]["n"] == len(rows)  # the OOM rows are kept apart, not dropped
    assert result.table["analytic"]["oom_caught"] == 0.0
    assert result.table["hybrid"]["oom_caught"] == 1.0
    assert result.table["hybrid"]["n_oom"] == len(oom)


def test_trace_features_join_by_spec_and_run_the_trace_tier_at_predict_time(rows, tmp_path):
    import dataclasses

    from hybridmem.learned.model import ResidualRegressor
    from hybridmem.learned.predictor import estimate
    from hybridmem.learned.train import build_table_for

    trace = rows.assign(source="trace")  # stand-in trace rows: same specs, peaks = the targets
    both = pd.concat([rows, trace], ignore_index=True)
    table = build_table_for(both, ("analytic",), toy_base, with_trace=True)
    ratio = table.X["trace_over_base"].to_numpy()
    np.testing.assert_allclose(ratio, np.exp(table.target("device")))  # joined to its own spec
    with pytest.raises(SpecError, match="with_trace"):
        build_table_for(both, ("trace",), toy_base, with_trace=True)

    est = ResidualRegressor(**FAST).fit(table.X, table.target("device"))
    registry.save(tmp_path / "registry" / "tr", {"device": est}, {
        "targets": ["device"], "trace_features": True, "torch_versions": ["2.13.0"],
        "cuda_versions": [""], "gpu_names": ["cpu-trace"], "sources": ["analytic"],
        "trust": trusted_everywhere(["device"])})
    spec = TrainingSpec(model="tiny-llava", micro_batch=2, seq_len=200, precision="fp32")

    def fake_trace(s):  # the trace tier "sees" the 1.25 factor of this spec (as extra context)
        base = toy_base(s)
        device = int(base.peak.device_bytes * true_factor(s))
        bd = {**base.breakdown, "context": base.breakdown["context"] + device - base.peak.device_bytes}
        return dataclasses.replace(base, breakdown=bd,
                                   peak=dataclasses.replace(base.peak, device_bytes=device))

    def broken_trace(s):
        raise SpecError("model", s.model, reason="cannot run under fake tensors")

    pred = estimate(spec, trace_fn=fake_trace)
    assert any("trace tier ran" in n for n in pred.notes)
    assert pred.peak.device_bytes / toy_base(spec).peak.device_bytes == pytest.approx(1.25, rel=0.05)
    pred = estimate(spec, trace_fn=broken_trace)
    assert any("trace tier could not run" in n for n in pred.notes)


def test_rows_with_unreadable_specs_are_left_out_and_reported(rows):
    rows.loc[0, "spec_json"] = "{not json"
    rows.loc[1, "alloc_conf"] = None
    rows["cuda_version"] = None  # e.g. a writer that leaves it empty for trace rows
    table = build_table(rows, toy_base)
    assert len(table.rows) == len(rows) - 1
    assert "unreadable spec" in table.dropped[rows.loc[0, "spec_hash"]]


def test_catalogue_gpu_names_match_cuda_device_names():
    from hybridmem.learned.predictor import match_gpu

    meta = {"gpu_names": ["NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3"],
            "default_gpu": "NVIDIA H100 80GB HBM3"}
    assert match_gpu("a100-40gb", meta)[0] == "NVIDIA A100-SXM4-40GB"
    assert match_gpu("NVIDIA H100 80GB HBM3", meta)[0] == "NVIDIA H100 80GB HBM3"
    name, note = match_gpu("l40s", meta)
    assert name == "NVIDIA H100 80GB HBM3" and "not among the model's training GPUs" in note
    assert "most common training GPU" in match_gpu(None, meta)[1]
