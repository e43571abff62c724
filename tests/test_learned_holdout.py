"""Version- and source-held-out evaluation, per-group trust, per-group conformal bounds.

Rows come from `test_learned_support.make_rows` (made-up, labelled "analytic"); the base is
its `toy_base` (patched in by the autouse fixture of test_learned).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from hybridmem.learned import conformal, predictor, trust
from hybridmem.learned.evaluate import forward_splits, version_key
from hybridmem.learned.metrics import bound_coverage
from hybridmem.job.spec import TrainingSpec
from test_learned import FAST, _toy_base_and_registry  # noqa: F401 (autouse fixture)
from test_learned_support import SHAPES, make_rows


def versioned_rows() -> pd.DataFrame:
    """Two shapes per torch version: 2.7 (oldest), 2.9, 2.10 (newest; sorts before 2.9 as text)."""
    parts = [make_rows(shapes=SHAPES[i:i + 2], torch_version=v, seed=i)
             for i, v in ((0, "2.7.1+cu126"), (2, "2.9.0+cu128"), (4, "2.10.0"))]
    return pd.concat(parts, ignore_index=True)


# ---- the forward split ----


def test_forward_splits_train_only_on_older_versions():
    versions = ["2.9.0+cu128", "2.7.1", "2.0", "2.10.0", "2.9.1", None, "nightly"]
    splits = forward_splits(versions)
    assert [held for held, _, _ in splits] == ["2.7", "2.9", "2.10"]  # 2.0 has nothing older
    for held, train, test in splits:
        assert all(version_key(v) < version_key(held) for v, t in zip(versions, train) if t)
        assert all(version_key(v) == version_key(held) for v, t in zip(versions, test) if t)
        # unreadable versions are in no split
        assert not train[5] and not test[5] and not train[6] and not test[6]
    assert list(splits[1][2]) == [True, False, False, False, True, False, False]  # 2.9.0, 2.9.1


def test_holdout_by_torch_never_fits_on_a_newer_version(tmp_path, monkeypatch):
    import mlflow

    from hybridmem.learned import holdout, train

    rows = versioned_rows()
    path = tmp_path / "rows.parquet"
    rows.to_parquet(path)
    seen = []
    real = train.fit_residuals

    def spy(tables, *args, **kwargs):
        seen.append({version_key(v) for tb in tables.values() for v in tb.rows["torch_version"]})
        return real(tables, *args, **kwargs)

    monkeypatch.setattr(train, "fit_residuals", spy)
    result = holdout.holdout(str(path), "torch", tiers=("analytic",), estimator_params=FAST)
    assert [s.name for s in result.splits] == ["torch 2.9", "torch 2.10"]
    assert [s.trained_on for s in result.splits] == ["2.7", "2.7, 2.9"]
    # one outer fit per split, on versions strictly older than the held-out one
    assert seen == [{(2, 7)}, {(2, 7), (2, 9)}]
    for s, held in zip(result.splits, ("2.9", "2.10")):
        errs = result.errors[result.errors["split"] == s.name]
        assert {v.split("+")[0].rsplit(".", 1)[0] for v in errs["torch"]} == {held}
    table = result.table.set_index(["split", "figure", "tier", "group"])
    for split in ("torch 2.9", "torch 2.10"):
        # the made-up factor (1.0-1.35) is learnable: the residual beats the toy base held out
        assert table.loc[(split, "device", "hybrid", "all"), "mape"] < \
            table.loc[(split, "device", "analytic", "all"), "mape"]
        assert table.loc[(split, "device", "hybrid", "all"), "n_bound"] > 0
    # one MLflow run per held-out version, with the per-tier, per-group metrics
    assert len(result.run_ids) == 2
    run = mlflow.get_run(result.run_ids[0])
    assert run.data.params["held_out"] == "torch 2.9" and run.data.params["trained_on"] == "2.7"
    assert {"device_hybrid_all_mape", "device_analytic_full_p95_ape",
            "device_hybrid_all_bound_coverage", "reserved_residual_all_under_share"} \
        <= set(run.data.metrics)


def test_holdout_by_source_trains_on_the_other_source(tmp_path):
    from hybridmem.learned import holdout

    rows = versioned_rows()
    rows["source"] = "published"  # the split rule only; the rows are still made up
    rows["sweep_name"] = np.where(rows["torch_version"].str.startswith("2.7"), "bench-a", "bench-b")
    path = tmp_path / "rows.parquet"
    rows.to_parquet(path)
    result = holdout.holdout(str(path), "source", tiers=("analytic",), estimator_params=FAST,
                             track=False)
    assert [(s.name, s.trained_on) for s in result.splits] == [
        ("source bench-a", "bench-b"), ("source bench-b", "bench-a")]
    a = result.splits[0]
    assert (a.test == (rows["sweep_name"] == "bench-a").to_numpy()).all() and not (a.train & a.test).any()
    assert result.run_ids == []


# ---- trust by evidence ----


def _pred(group, measured, analytic, hybrid, upper):
    return pd.DataFrame({"job_group": group, "measured": measured, "analytic": analytic,
                         "hybrid": hybrid, "upper": upper})


def test_group_evidence_by_hand():
    pred = pd.concat([_pred("lora", [100, 100], [110, 106], [101, 97], [105, 99]),
                      _pred("full", [100], [98], [92], [104])])
    ev = trust.group_evidence(pred)
    assert ev["lora"]["rows"] == 2 and ev["lora"]["base_mape"] == pytest.approx(8.0)
    assert ev["lora"]["residual_mape"] == pytest.approx(2.0)
    assert ev["lora"]["coverage"] == pytest.approx(0.5) and ev["lora"]["under_share"] == 0.5
    assert ev["full"]["base_mape"] == pytest.approx(2.0) and ev["full"]["residual_mape"] == 8.0


def test_trust_needs_every_held_out_evaluation_to_beat_the_base():
    s = lambda res, base, n=4: {"rows": n, "residual_mape": res, "base_mape": base,  # noqa: E731
                                "coverage": 1.0, "under_share": 0.0}
    decided = trust.decide({
        "cv": {"lora": s(0.7, 6.4), "full": s(7.7, 1.6), "dora": s(1.8, 4.2),
               "other-peft": s(1.0, 2.0, n=0)},
        "torch": {"lora": s(2.4, 6.6), "dora": s(3.1, 2.9)}})
    assert decided["lora"]["apply"] and decided["lora"]["rule"] == "beats-base"
    assert set(decided["lora"]["evidence"]) == {"cv", "torch"}
    assert not decided["full"]["apply"] and decided["full"]["rule"] == "not-better"
    # better under CV, worse on the later torch: not trusted
    assert not decided["dora"]["apply"] and decided["dora"]["rule"] == "not-better"
    assert decided["other-peft"] == {"apply": False, "rule": "no-evidence", "evidence": {}}
    assert trust.decision(None, "device", "lora")["rule"] == "not-recorded"
    assert trust.decision({"device": decided}, "device", "partial")["rule"] == "no-evidence"
    note = trust.describe(decided["lora"], "reserved", "lora")
    assert note.startswith("reserved residual applies to lora jobs: its held-out error is below")
    assert "grouped CV: 4 rows, MAPE 0.7 % vs 6.4 %" in note
    # the bound's coverage is stated from the torch hold-out when it has rows of the group
    assert trust.coverage_source(decided["lora"])["source"] == "torch-version hold-out"


def _trained(tmp_path, torch_version="2.9.0"):
    from hybridmem.learned.train import train

    rows = make_rows(shapes=SHAPES[:4], torch_version=torch_version)
    rows["source"] = "cuda"  # the selection and trust rules only; the rows are made up
    path = tmp_path / "rows.parquet"
    rows.to_parquet(path)
    out = tmp_path / "registry" / "m"
    train(str(path), str(out), estimator_params=FAST, track=False)
    return rows, out


def _spec(rows, **changes) -> TrainingSpec:
    from hybridmem.models.loader import materialize_config

    return TrainingSpec.from_dict({**json.loads(rows.iloc[0]["spec_json"]),
                                   "model": materialize_config(rows.iloc[0]["model_config"]),
                                   **changes})


def test_a_trusted_group_gets_the_residual_and_its_bound(tmp_path, monkeypatch):
    rows, out = _trained(tmp_path)
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["trust"]["device"]["full"]["apply"] is True
    assert meta["trust"]["device"]["full"]["rule"] == "beats-base"
    monkeypatch.setenv("HYBRIDMEM_TORCH_VERSION", "2.13.0")  # outside the trained 2.9
    pred = predictor.estimate(_spec(rows), models_dir=tmp_path / "registry")
    assert pred.extras["residual_model"] == "m"
    assert pred.extras["trust"]["device"]["applied"] is True
    assert pred.extras["bound_bytes"] == pred.extras["upper_bound_bytes"] >= pred.peak.device_bytes
    cov = pred.extras["bound_coverage"]
    assert cov["source"] == "grouped CV" and cov["nominal"] == 0.95 and 0 <= cov["coverage"] <= 1
    assert any(n.startswith("device residual applies to full jobs") for n in pred.notes)
    # a torch outside the training set is a stated uncertainty, not a refusal
    assert any(n.startswith("torch 2.13 is not among the trained versions (2.9)") for n in pred.notes)
    assert predictor.default_method(tmp_path / "registry") == "hybrid"
    assert predictor.default_method(tmp_path / "registry", spec=_spec(rows)) == "hybrid"


def test_an_untrusted_group_gets_the_base_tier_and_the_rule_that_decided(tmp_path):
    from test_learned_support import toy_base

    rows, out = _trained(tmp_path)
    meta_path = out / "metadata.json"
    meta = json.loads(meta_path.read_text())
    for t in meta["trust"]:  # as if the held-out evidence had gone against the residual
        meta["trust"][t]["full"].update(apply=False, rule="not-better")
    meta_path.write_text(json.dumps(meta))
    spec = _spec(rows)
    pred = predictor.estimate(spec, models_dir=tmp_path / "registry")
    assert pred.peak == toy_base(spec).peak and pred.extras["fallback"] == "analytic"
    assert pred.extras["bound_bytes"] is None
    assert pred.extras["trust"]["device"] == {**pred.extras["trust"]["device"], "applied": False,
                                              "rule": "not-better", "group": "full"}
    assert any(n.startswith("device residual does not apply to full jobs: its held-out error is "
                            "not below the base tier's (grouped CV: ") for n in pred.notes)
    assert predictor.default_method(tmp_path / "registry", spec=spec) == "analytic"


def test_the_fit_verdict_uses_the_bound():
    from hybridmem.categories import empty_breakdown
    from hybridmem.prediction import Peak, Prediction

    bd = empty_breakdown()
    bd["param"] = 90
    peak = Peak(allocated_bytes=90, reserved_bytes=90, device_bytes=90, phase="forward", iteration=0)
    p = Prediction(model="m", method="hybrid", params_total=1, params_trainable=1, peak=peak,
                   breakdown=bd, modules=(), gpu_name="g", gpu_memory_bytes=100,
                   extras={"bound_bytes": 105})
    assert p.peak.device_bytes <= 100 and p.fits is False and p.headroom_bytes == -5
    assert p.to_dict()["bound_bytes"] == 105
    no_bound = Prediction(model="m", method="analytic", params_total=1, params_trainable=1,
                          peak=peak, breakdown=bd, modules=(), gpu_name="g", gpu_memory_bytes=100)
    assert no_bound.fits is True and no_bound.headroom_bytes == 10


# ---- per-group conformal bounds ----


def test_conformal_quantile_and_group_margins_by_hand():
    # ceil((n + 1) 0.95)-th smallest (Barber et al. 2021): n = 19 -> 19th, n = 39 -> 38th
    assert conformal.min_rows(0.95) == 19
    assert conformal.conformal_quantile(np.arange(1, 20), 0.95) == 19
    assert conformal.conformal_quantile(np.arange(1, 40), 0.95) == 38
    assert conformal.conformal_quantile([3, 1, 2], 0.95) == 3  # too few rows: the largest
    scores = np.concatenate([np.arange(1, 40), [0.5, 0.5, 0.5]])
    strata = ["lora"] * 39 + ["full"] * 3
    m = conformal.group_margins(scores, strata, 0.95)
    # pooled: 42 scores -> 41st smallest = 38; full (3 rows) cannot state its own quantile
    assert m == {"*": 38.0, "lora": 38.0, "full": 38.0}
    m = conformal.group_margins(np.concatenate([np.arange(1, 40) / 100, [0.9] * 3]), strata, 0.95)
    assert m["lora"] == pytest.approx(0.38) and m["full"] == pytest.approx(0.9)
    assert conformal.margin_for(m, "dora") == pytest.approx(0.9)  # unseen: the widest margin


def test_a_conformal_margin_covers_fresh_draws_at_its_level():
    # known answer: exchangeable scores -> coverage >= 0.95 in expectation, ~ 190 / 200 here
    rng = np.random.default_rng(7)
    calib = rng.uniform(0, 1, 199)
    margin = conformal.conformal_quantile(calib, 0.95)
    fresh = rng.uniform(0, 1, 20000)
    cov = bound_coverage(np.full(fresh.shape, margin), fresh)
    assert 0.93 <= cov <= 0.97
    assert bound_coverage([1, 2, 3], [1, 3, 2]) == pytest.approx(2 / 3)


def test_the_regressor_keeps_one_margin_per_job_group(tmp_path):
    from hybridmem.learned.features import build_table
    from hybridmem.learned.model import ResidualRegressor

    table = build_table(make_rows(shapes=SHAPES[:3]))
    est = ResidualRegressor(**FAST).fit(table.X, table.target("device"), table.groups)
    assert set(est.margins_) == {"*", "full"} and est.margin_ == est.margins_["*"]
    est.save(tmp_path, "device")
    back = ResidualRegressor.load(tmp_path, "device")
    assert back.margins_ == est.margins_
    assert np.allclose(back.predict_upper(table.X), est.predict_upper(table.X))
    assert (est.predict_upper(table.X) >= est.predict(table.X) + est.margins_["full"] - 1e-12).all()


def test_the_next_gpu_sweep_measures_full_fine_tuning_first():
    from pathlib import Path

    from hybridmem.harness.sweep import load_sweep

    # full fine-tuning is the group the published rows hold one configuration of
    sweep = load_sweep(Path(__file__).resolve().parents[1] / "datasets/sweeps/h200-first.toml")
    first = [it.spec.train for it in sweep.items[:10]]
    assert first == ["full"] * 10
    published_setting = [it for it in sweep.items if it.block == "full-ft-published-setting"]
    assert {(it.spec.precision, it.spec.loop, it.spec.micro_batch) for it in published_setting} \
        == {("bf16", "custom", 4)}


def test_cli_holdout_prints_each_split_and_logs_to_the_tracking_dir(tmp_path, capsys, monkeypatch):
    import os

    from hybridmem.cli import main

    rows = versioned_rows()
    rows = rows[~rows["torch_version"].str.startswith("2.10")]  # one split: 2.9 held out
    path = tmp_path / "rows.parquet"
    rows.to_parquet(path)
    # `--tracking` sets the store for this process; monkeypatch restores the session's after
    monkeypatch.setenv("HYBRIDMEM_MLFLOW_URI", os.environ["HYBRIDMEM_MLFLOW_URI"])
    store = tmp_path / "ml"
    rc = main(["evaluate", "--data", str(path), "--holdout", "torch", "--tiers", "analytic",
               "--tracking", str(store), "--errors-csv", str(tmp_path / "e.csv")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "held out: torch 2.9 (residual trained on 2.7)" in out
    assert "MLflow runs (experiment holdout): " in out and (store / "mlflow.db").exists()
    errors = pd.read_csv(tmp_path / "e.csv")
    assert set(errors["tier"]) == {"analytic", "residual", "hybrid"}
    assert set(errors["split"]) == {"torch 2.9"}


@pytest.mark.parametrize("argv, message", [
    (["--holdout", "gpu"], "holdout='gpu'"),
    (["--holdout", "torch", "--tiers", "hybrid"], "tiers='hybrid'"),
])
def test_cli_holdout_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, message):
    from hybridmem.cli import main

    path = tmp_path / "rows.parquet"
    make_rows(shapes=SHAPES[:2]).to_parquet(path)
    rc = main(["evaluate", "--data", str(path), "--no-track", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err
