"""`hybridmem collect` end to end: trace backend, killed midway, resumed; and its error contract."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hybridmem.harness import load_dataset, load_sweep
from hybridmem.harness.store import part_files

SWEEP = """
[sweep]
name = "kill-resume"
[[block]]
decoder = ["llama-tiny"]
micro_batch = [1, 2, 3]
seq_len = [16, 32]
precision = ["fp32"]
"""
TOTAL = 6  # 3 micro-batches x 2 lengths


def _env(tmp_path: Path) -> dict:
    env = dict(os.environ)
    env.pop("HYBRIDMEM_PROBE", None)
    env["HYBRIDMEM_MLFLOW_URI"] = (tmp_path / "mlruns").as_uri()
    env["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 refuses file stores unless told
    return env


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hybridmem", "collect", *args]


def test_trace_collect_killed_midway_then_resumed(tmp_path):
    sweep, out = tmp_path / "s.toml", tmp_path / "data"
    sweep.write_text(SWEEP)
    env = _env(tmp_path)
    args = ["--sweep", str(sweep), "--backend", "trace", "--out", str(out)]
    proc = subprocess.Popen(_cli(*args), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not part_files(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # no clean-up code runs: a hard kill mid-sweep
    proc.wait()
    first = load_dataset(out)
    assert 1 <= len(first) < TOTAL, "the kill should land after the first row and before the end"

    done = subprocess.run(_cli(*args, "--resume"), env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"skipped (already measured): {len(first)}" in done.stdout
    df = load_dataset(out)
    expected = {it.spec_hash for it in load_sweep(sweep).items}
    assert len(df) == TOTAL and set(df["spec_hash"]) == expected  # every spec exactly once
    assert set(df["source"]) == {"trace"} and set(df["outcome"]) == {"ok"}
    kept = df.set_index("spec_hash").loc[list(first["spec_hash"]), "collected_at"]
    assert list(kept) == list(first["collected_at"])  # rows of the killed run were not redone
    assert (df["peak_allocated_bytes"] <= df["peak_reserved_bytes"]).all()
    assert (df["peak_reserved_bytes"] <= df["peak_device_bytes"]).all()
    assert len(part_files(out)) == 1  # compacted at the end of the run
    assert list((tmp_path / "mlruns").rglob("summary.json"))  # the run is tracked in MLflow
    # every row rebuilds into its spec: the analytic tier predicts each one
    from hybridmem.harness.compare import compare, spread

    summary = spread(compare(df, "analytic"))
    assert summary["ok_rows"] == TOTAL and summary["tier_errors"] == 0


def test_cuda_backend_without_cuda_is_a_one_line_error(capsys, monkeypatch):
    from hybridmem.cli import main

    monkeypatch.delenv("HYBRIDMEM_PROBE", raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # also on a GPU machine
    sweep = Path(__file__).resolve().parents[1] / "datasets" / "sweeps" / "ci-tiny.toml"
    code = main(["collect", "--sweep", str(sweep), "--backend", "cuda"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1
    assert "backend='cuda'" in err and "no CUDA device" in err


def test_malformed_sweep_is_a_one_line_error_naming_the_field(tmp_path, capsys):
    from hybridmem.cli import main

    bad = tmp_path / "bad.toml"
    bad.write_text('[[block]]\ndecoder = ["llama-tiny"]\nmicro_batch = [0]\n')
    code = main(["collect", "--sweep", str(bad), "--backend", "trace", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "block[0].micro_batch=0" in err and "positive integer" in err
