"""`collect --ray` on a local Ray cluster: the rows of a local run, a killed worker retried, a
killed driver resumed. One cluster for the module (Ray's start-up is the slow part).

The CPU stand-in probe (`HYBRIDMEM_PROBE`) runs the real child process per config; the trace
backend runs the trace tier in the task. Both need no GPU, so tasks ask for none.

The cluster tests are not in the default run (marked `slow`): Ray's start-up and a fresh worker
per job importing torch cost minutes on a 2-core machine. Run them with
`pip install -e '.[test,ray]' && python -m pytest -m slow tests/test_collect_ray.py`. The two
tests without a cluster (a task with no result, Ray missing) run by default.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from hybridmem.harness.probe import CpuProbe

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MARK_ENV = "HYBRIDMEM_TEST_FAULT_MARK"  # forwarded to the tasks: it starts with HYBRIDMEM_
STARTS_ENV = "HYBRIDMEM_TEST_STARTS"

SWEEP = """
[sweep]
name = "ray-{name}"
timeout_s = 120
[[block]]
decoder = ["llama-tiny"]
micro_batch = {batches}
seq_len = {lengths}
precision = ["fp32"]
"""
TIME_COLUMNS = ("collected_at", "wall_seconds", "step_seconds")
"""Columns that differ between two runs of the same config (when and how long)."""


class KillWorkerProbe(CpuProbe):
    """The first config kills the Ray worker that launched it (as a node losing the task would),
    then exits; every child notes its start, so the rerun can be counted."""

    def phase_start(self, phase: str, iteration: int) -> None:
        if phase != "setup":
            return
        with open(os.environ[STARTS_ENV], "a") as fh:
            fh.write(f"{os.getpid()}\n")
        mark = Path(os.environ[MARK_ENV])
        if not mark.exists():
            mark.write_text("seen")
            os.kill(os.getppid(), signal.SIGKILL)  # the child's parent is the Ray worker
            os._exit(1)


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for the module: 2 CPUs, no dashboard; its GCS address."""
    ray = pytest.importorskip("ray")
    saved = os.environ.get("PYTHONPATH")
    # the workers' children import the stand-in probe above from this folder
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO), saved or ""])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def _sweep(tmp_path: Path, name: str, batches: str, lengths: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(SWEEP.format(name=name, batches=batches, lengths=lengths))
    return path


def _raw_rows(out: Path) -> pd.DataFrame:
    """Every row of every part file, duplicates included (the reader would keep one)."""
    from hybridmem.harness.store import part_files

    return pd.concat([pd.read_parquet(f) for f in part_files(out)], ignore_index=True)


@pytest.mark.slow
def test_ray_rows_equal_the_local_rows(cluster, tmp_path, monkeypatch):
    from hybridmem.harness import collect, load_dataset
    from hybridmem.harness.fleet import collect_ray

    monkeypatch.setenv("HYBRIDMEM_MLFLOW_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses file stores unless told
    sweep = _sweep(tmp_path, "same", "[1, 2]", "[16, 32]")
    collect(sweep, out=tmp_path / "local", backend="trace", mlflow=False)
    report = collect_ray(sweep, address=cluster, out=tmp_path / "ray", backend="trace")
    local = load_dataset(tmp_path / "local").set_index("spec_hash").sort_index()
    fleet = load_dataset(tmp_path / "ray").set_index("spec_hash").sort_index()
    assert len(local) == 4 and list(fleet.index) == list(local.index)
    pd.testing.assert_frame_equal(fleet.drop(columns=list(TIME_COLUMNS)),
                                  local.drop(columns=list(TIME_COLUMNS)))
    # one MLflow run for the sweep, with its rows counted per node (one node here)
    summaries = list((tmp_path / "mlruns").rglob("summary.json"))
    assert len(summaries) == 1
    summary = json.loads(summaries[0].read_text())
    assert summary["rows_per_node"] == {local["hostname"].iloc[0]: 4} == dict(report.nodes)


@pytest.mark.slow
def test_a_killed_worker_is_retried_without_a_duplicate_or_a_lost_row(cluster, tmp_path,
                                                                      monkeypatch):
    from hybridmem.harness import load_sweep
    from hybridmem.harness.fleet import collect_ray

    monkeypatch.setenv("HYBRIDMEM_PROBE", "test_collect_ray:KillWorkerProbe")
    monkeypatch.setenv(MARK_ENV, str(tmp_path / "fault-mark"))
    monkeypatch.setenv(STARTS_ENV, str(tmp_path / "starts"))
    sweep = _sweep(tmp_path, "kill-worker", "[1, 2, 3]", "[16]")
    report = collect_ray(sweep, address=cluster, out=tmp_path / "data", backend="cuda",
                         mlflow=False)
    assert (tmp_path / "fault-mark").exists()  # a worker was killed
    starts = (tmp_path / "starts").read_text().split()
    assert len(starts) == 4  # 3 configs + the rerun of the one whose worker died
    raw = _raw_rows(tmp_path / "data")
    expected = {it.spec_hash for it in load_sweep(sweep).items}
    assert sorted(raw["spec_hash"]) == sorted(expected)  # each spec once: none twice, none lost
    assert set(raw["outcome"]) == {"ok"} and report.counts == {"ok": 3}
    assert set(raw["source"]) == {"dryrun"} and set(raw["gpu_name"]) == {"cpu-dryrun"}


@pytest.mark.slow
def test_a_killed_driver_then_resume_completes_the_sweep(cluster, tmp_path):
    from hybridmem.harness import load_dataset, load_sweep
    from hybridmem.harness.store import part_files

    sweep, out = _sweep(tmp_path, "kill-driver", "[1, 2, 3]", "[16, 32]"), tmp_path / "data"
    total = 6  # 3 micro-batches x 2 lengths
    env = {**os.environ, "HYBRIDMEM_MLFLOW_URI": (tmp_path / "mlruns").as_uri(),
           "MLFLOW_ALLOW_FILE_STORE": "true"}
    env.pop("HYBRIDMEM_PROBE", None)
    cmd = [sys.executable, "-m", "hybridmem", "collect", "--sweep", str(sweep), "--backend",
           "trace", "--out", str(out), "--ray", cluster]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not part_files(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # no clean-up code runs: the driver dies mid-sweep
    proc.wait()
    first = _raw_rows(out)
    assert 1 <= len(first) < total, "the kill should land after the first row and before the end"

    done = subprocess.run([*cmd, "--resume"], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"skipped (already measured): {len(first)}" in done.stdout
    assert f"outcomes: ok {total - len(first)};" in done.stdout  # the rest, each written once
    df = load_dataset(out)
    expected = {it.spec_hash for it in load_sweep(sweep).items}
    assert len(df) == total and set(df["spec_hash"]) == expected
    kept = df.set_index("spec_hash").loc[list(first["spec_hash"]), "collected_at"]
    assert list(kept) == list(first["collected_at"])  # rows of the killed run were not redone


ENV = {"gpu_name": "NVIDIA H100 80GB HBM3", "gpu_memory_bytes": 85_520_809_984,
       "driver_version": "550.54.15", "cuda_version": "12.4", "torch_version": "2.13.0",
       "transformers_version": "5.24.0", "alloc_conf": "", "hostname": "node-a"}
"""One node's environment columns (values of the shape the CUDA probe reports; no measurement)."""


def test_a_task_without_a_result_is_an_error_row(tmp_path):
    from hybridmem.harness import load_sweep
    from hybridmem.harness.fleet import failure_row
    from hybridmem.harness.store import append_rows, load_dataset

    sweep = load_sweep(_sweep(tmp_path, "lost", "[1]", "[16]"))
    item = sweep.items[0]
    # two nodes of one GPU type: the row takes their environment, with no hostname
    same = {"a": ("cuda", ENV), "b": ("cuda", {**ENV, "hostname": "node-b"})}
    row = failure_row(item, "ray task failed: WorkerCrashedError: ...", same, "cuda", sweep, 1.0)
    assert row["outcome"] == "error" and row["error"].startswith("ray task failed")
    assert (row["gpu_name"], row["torch_version"], row["hostname"]) == (
        ENV["gpu_name"], "2.13.0", "")
    assert row["peak_allocated_bytes"] is None  # no result, no peak
    # two GPU types: which one it died on is unknown, so the GPU columns stay empty
    mixed = {**same, "c": ("cuda", {**ENV, "gpu_name": "NVIDIA A100-SXM4-80GB"})}
    unknown = failure_row(item, "ray task timed out after 1 s", mixed, "cuda", sweep, 1.0)
    assert unknown["gpu_name"] is None and unknown["torch_version"] is None
    append_rows(tmp_path / "data", [row, unknown])  # both fit the dataset's schema
    assert list(load_dataset(tmp_path / "data")["outcome"]) == ["error", "error"]


def test_ray_missing_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    from hybridmem.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    sweep = _sweep(tmp_path, "no-ray", "[1]", "[16]")
    code = main(["collect", "--sweep", str(sweep), "--backend", "trace", "--out",
                 str(tmp_path / "data"), "--ray", "local"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "ray='not installed'" in err and "hybridmem[ray]" in err
