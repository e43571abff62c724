"""The MLflow wrapper logs to a local store with no server, wherever the env points it."""

from __future__ import annotations

import pytest

from hybridmem.tracking import start_run

mlflow = pytest.importorskip("mlflow")


@pytest.mark.parametrize("kind", ["sqlite", "file", "path"])
def test_run_is_logged_locally(tmp_path, monkeypatch, kind):
    uri = {"sqlite": f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}",
           "file": (tmp_path / "store").as_uri(),
           "path": str(tmp_path / "store")}[kind]
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow 3 needs it for files
    monkeypatch.setenv("HYBRIDMEM_MLFLOW_URI", uri)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)  # MLflow's own default would put artifacts in ./mlruns here
    art = tmp_path / "a.txt"
    art.write_text("x")
    with start_run("unit", run_name="r1") as run:
        run.params({"a": 1})
        run.metrics({"mape": 0.1})
        run.artifact(art)
        run.json_artifact({"k": 2}, "obj.json")
    got = mlflow.get_run(run.run_id)
    assert got.data.params["a"] == "1" and got.data.metrics["mape"] == pytest.approx(0.1)
    names = {f.path for f in mlflow.MlflowClient().list_artifacts(run.run_id)}
    assert names == {"a.txt", "obj.json"}
    assert list(work.iterdir()) == []  # nothing written in the working directory


def test_disabled_run_is_a_no_op():
    with start_run("unit", enabled=False) as run:
        run.params({"a": 1})
        run.metrics({"m": 1.0})
        assert run.run_id is None
