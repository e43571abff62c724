"""`hybridmem train` / `hybridmem evaluate` through typer, and the pipeline on collected trace rows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from hybridmem.errors import SpecError
from test_learned_support import make_rows, toy_base

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def app() -> typer.Typer:
    from hybridmem.cli import evaluate, train

    app = typer.Typer()
    train.register(app)
    evaluate.register(app)
    return app


@pytest.fixture(autouse=True)
def _toy_base(monkeypatch, tmp_path):
    monkeypatch.setattr("hybridmem.learned.features.analytic_base", toy_base)
    monkeypatch.setenv("HYBRIDMEM_TORCH_VERSION", "2.13.0")
    monkeypatch.setenv("HYBRIDMEM_MODELS", str(tmp_path / "models"))


@pytest.fixture
def data_file(tmp_path) -> str:
    path = tmp_path / "rows.parquet"
    make_rows().to_parquet(path)
    return str(path)


def test_train_then_evaluate_prints_tables_and_plot(app, data_file, tmp_path):
    runner = CliRunner()
    out = tmp_path / "models" / "a"
    res = runner.invoke(app, ["train", "--data", data_file, "--out", str(out), "--folds", "3"])
    assert res.exit_code == 0, res.output
    assert "MAPE" in res.output and "hybrid" in res.output and "calibrated_to_gpu=false" in res.output
    assert "NOT calibrated to GPUs" in res.output
    plot = tmp_path / "pvm.png"
    res = runner.invoke(app, ["evaluate", "--data", data_file, "--folds", "3", "--plot", str(plot)])
    assert res.exit_code == 0, res.output
    for word in ("analytic", "hybrid", "MAPE%", "P95APE%", "under", "verdict", "bound"):
        assert word in res.output
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_evaluate_compares_two_registry_models_on_held_out_shapes(app, tmp_path):
    from test_learned_support import SHAPES

    runner = CliRunner()
    train_file, test_file = tmp_path / "train.parquet", tmp_path / "test.parquet"
    make_rows(shapes=SHAPES[:4]).to_parquet(train_file)
    make_rows(shapes=SHAPES[4:], seed=1).to_parquet(test_file)
    for name in ("a", "b"):
        res = runner.invoke(app, ["train", "--data", str(train_file), "--out",
                                  str(tmp_path / "models" / name), "--folds", "2", "--no-track"])
        assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["evaluate", "--data", str(test_file), "--model",
                              str(tmp_path / "models" / "a"), "--model", str(tmp_path / "models" / "b")])
    assert res.exit_code == 0, res.output
    assert "hybrid:a" in res.output and "hybrid:b" in res.output
    assert "16 held-out rows (2 model shapes" in res.output  # 2 shapes x 8 specs in make_rows


def test_cli_bad_inputs_raise_spec_errors(app, data_file, tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["train", "--data", str(tmp_path / "nope.parquet"), "--out", str(tmp_path / "m")])
    assert isinstance(res.exception, SpecError) and "no such file" in str(res.exception)
    res = runner.invoke(app, ["train", "--data", data_file, "--out", str(tmp_path / "m"), "--target", "x"])
    assert isinstance(res.exception, SpecError) and "valid: device, reserved, both" in str(res.exception)
    res = runner.invoke(app, ["evaluate", "--data", data_file, "--model", str(tmp_path)])
    assert isinstance(res.exception, SpecError) and "no metadata.json" in str(res.exception)
    assert not (tmp_path / "m").exists()


def _collect_trace_rows(app: typer.Typer, out: Path) -> None:
    """Run `hybridmem collect --backend trace` on the CI sweep; a failing collect fails the test."""
    from hybridmem.cli import collect

    sweep = ROOT / "datasets" / "sweeps" / "ci-tiny.toml"
    collect.register(app)
    res = CliRunner().invoke(app, ["collect", "--sweep", str(sweep), "--backend", "trace",
                                   "--out", str(out)])
    assert res.exit_code == 0, f"{res.output[-2000:]} {res.exception!r}"


def test_pipeline_on_rows_from_collect_backend_trace(app, tmp_path, monkeypatch):
    """The whole pipeline on `hybridmem collect --backend trace` rows (no GPU anywhere), with the
    real analytic tier as the base (the toy base of the other tests is undone)."""
    monkeypatch.undo()
    monkeypatch.setenv("HYBRIDMEM_TORCH_VERSION", "2.13.0")
    monkeypatch.setenv("HYBRIDMEM_MODELS", str(tmp_path / "models"))
    data = tmp_path / "trace-rows"
    _collect_trace_rows(app, data)
    from hybridmem.learned.dataset import load

    rows = load(data)
    assert set(rows["source"]) == {"trace"}
    out = tmp_path / "models" / "trace-model"
    res = CliRunner().invoke(app, ["train", "--data", str(data), "--out", str(out), "--folds", "2"])
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["calibrated_to_gpu"] is False and meta["sources"] == ["trace"]
    res = CliRunner().invoke(app, ["evaluate", "--data", str(data), "--folds", "2"])
    assert res.exit_code == 0, res.output
    assert "rows are trace output, not real CUDA measurements" in res.output
    from hybridmem.learned.predictor import estimate as hybrid
    from hybridmem.job.spec import TrainingSpec

    pred = hybrid(TrainingSpec(model="tiny-llava", micro_batch=1, seq_len=64))
    assert any("NOT calibrated to real GPUs" in n for n in pred.notes)
    shutil.rmtree(out)
