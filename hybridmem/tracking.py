"""A small wrapper around MLflow: imported lazily, a local store, no server.

Both `hybridmem collect` and `hybridmem train` log runs here. The default store is MLflow's
own default backend (a SQLite file, MLflow >= 3) placed in `experiments/mlruns/mlflow.db`,
with artifacts in `experiments/mlruns/artifacts`, under the current directory. Override with
`HYBRIDMEM_MLFLOW_URI` or `MLFLOW_TRACKING_URI` (tests point it at a temporary folder); a
`file:` URI selects MLflow's older file store, which MLflow 3 only opens with
`MLFLOW_ALLOW_FILE_STORE=true` (set here for that case).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

DEFAULT_STORE = Path("experiments") / "mlruns"


def tracking_uri() -> str:
    """Where runs go: env override, else a SQLite file in the local store folder."""
    uri = os.environ.get("HYBRIDMEM_MLFLOW_URI") or os.environ.get("MLFLOW_TRACKING_URI")
    return uri or f"sqlite:///{(DEFAULT_STORE / 'mlflow.db').resolve()}"


def _artifact_root(uri: str) -> str | None:
    """Artifacts beside a SQLite store (MLflow would otherwise write ./mlruns in the cwd)."""
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        return (db.parent / "artifacts").resolve().as_uri()
    return None


def _prepare(mlflow, experiment: str) -> None:
    uri = tracking_uri()
    if uri.startswith("file:") or "://" not in uri:
        # a file: URI or a plain folder path is MLflow's file store, which MLflow 3 refuses
        # unless opted in (FileStore.__init__'s error names this variable)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        mlflow.create_experiment(experiment, artifact_location=_artifact_root(uri))
    mlflow.set_experiment(experiment)


class Run:
    """Logging handle for one MLflow run; methods no-op when MLflow is unavailable."""

    def __init__(self, mlflow_module, run) -> None:
        self._mlflow = mlflow_module
        self.run = run
        self.run_id: str | None = run.info.run_id if run is not None else None

    def params(self, values: Mapping[str, object]) -> None:
        if self._mlflow:
            self._mlflow.log_params({k: str(v)[:500] for k, v in values.items()})

    def metrics(self, values: Mapping[str, float], step: int | None = None) -> None:
        if self._mlflow:
            self._mlflow.log_metrics({k: float(v) for k, v in values.items()}, step=step)

    def artifact(self, path: str | os.PathLike, subdir: str | None = None) -> None:
        if self._mlflow:
            self._mlflow.log_artifact(str(path), artifact_path=subdir)

    def json_artifact(self, obj: object, name: str) -> None:
        if self._mlflow:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / name
                path.write_text(json.dumps(obj, indent=2, default=str))
                self._mlflow.log_artifact(str(path))

    def tags(self, values: Mapping[str, str]) -> None:
        if self._mlflow:
            self._mlflow.set_tags(dict(values))


@contextlib.contextmanager
def start_run(experiment: str, run_name: str | None = None,
              enabled: bool = True) -> Iterator[Run]:
    """Open an MLflow run in `experiment` (created if missing); yields a `Run`.

    With `enabled=False` (or MLflow missing) yields a `Run` whose methods do nothing, so
    callers need no branches.
    """
    if not enabled:
        yield Run(None, None)
        return
    try:
        import mlflow
    except ImportError:  # the `learned` extra is not installed
        yield Run(None, None)
        return
    _prepare(mlflow, experiment)
    with mlflow.start_run(run_name=run_name) as run:
        yield Run(mlflow, run)
