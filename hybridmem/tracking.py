"""A small wrapper around MLflow: imported lazily, local file store, no server.

Both `hybridmem collect` and `hybridmem train` log runs here. The default store is
`experiments/mlruns` under the current directory (override with `HYBRIDMEM_MLFLOW_URI` or
`MLFLOW_TRACKING_URI`), so tests can point it at a temporary folder.
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
    """Where runs go: env override, else a local folder (file store, no server)."""
    uri = os.environ.get("HYBRIDMEM_MLFLOW_URI") or os.environ.get("MLFLOW_TRACKING_URI")
    return uri or DEFAULT_STORE.resolve().as_uri()


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
    mlflow.set_tracking_uri(tracking_uri())
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=run_name) as run:
        yield Run(mlflow, run)
