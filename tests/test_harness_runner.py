"""The subprocess path on CPU: OOM, a killed child and a hung child each give a labelled row.

The child process loads the probe named by HYBRIDMEM_PROBE; the stand-ins below (imported by the
child from this file) replace the CUDA calls and inject the failure. The sweep must go on.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from hybridmem.harness.probe import CpuProbe

HERE = Path(__file__).resolve().parent
MARK_ENV = "HYBRIDMEM_TEST_FAULT_MARK"

SWEEP = """
[sweep]
name = "faults"
timeout_s = {timeout}
[[block]]
decoder = ["llama-tiny"]
seq_len = [16]
micro_batch = {batches}
precision = ["fp32"]
"""


def _first_time() -> bool:
    """True in the first child that asks (a marker file, shared through the environment)."""
    mark = Path(os.environ[MARK_ENV])
    if mark.exists():
        return False
    mark.write_text("seen")
    return True


class OomProbe(CpuProbe):
    """The first forward pass raises the allocator's OOM, as CUDA would."""

    def phase_start(self, phase: str, iteration: int) -> None:
        if phase == "forward":
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


class KillProbe(CpuProbe):
    """The first measured config dies by SIGKILL (as the kernel's OOM killer would do)."""

    def phase_start(self, phase: str, iteration: int) -> None:
        if phase == "setup" and _first_time():
            os.kill(os.getpid(), signal.SIGKILL)


class HangProbe(CpuProbe):
    """The first measured config hangs (a deadlocked kernel, say)."""

    def phase_start(self, phase: str, iteration: int) -> None:
        if phase == "setup" and _first_time():
            time.sleep(600)


def collect_with_probe(tmp_path, monkeypatch, probe: str, sweep_text: str, **options):
    """`collect` of `sweep_text` on the cuda backend with the stand-in probe `module:Class`
    (a class of a test module here, which every child imports through PYTHONPATH); the report
    and the dataset folder. Shared with test_harness_multirank."""
    from hybridmem.harness import collect

    monkeypatch.setenv("HYBRIDMEM_PROBE", probe)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(sweep_text)
    out = tmp_path / "data"
    return collect(sweep, out=out, backend="cuda", mlflow=False, **options), out


def _collect(tmp_path, monkeypatch, probe: str, batches: str, timeout: float = 120,
             record_history: bool = False):
    from hybridmem.harness import load_dataset

    monkeypatch.setenv(MARK_ENV, str(tmp_path / "fault-mark"))
    report, out = collect_with_probe(tmp_path, monkeypatch, f"test_harness_runner:{probe}",
                                     SWEEP.format(timeout=timeout, batches=batches),
                                     record_history=record_history)
    return report, load_dataset(out)


def test_out_of_memory_in_the_child_is_an_oom_row(tmp_path, monkeypatch):
    report, df = _collect(tmp_path, monkeypatch, "OomProbe", "[1]", record_history=True)
    assert report.counts == {"oom": 1}
    row = df.iloc[0]
    # the allocator history of an OOM run is kept: it is what the simulator is checked against
    assert row["history_path"].startswith("history/")
    assert (tmp_path / "data" / row["history_path"]).is_file()
    assert row["outcome"] == "oom" and row["oom_phase"] == "forward"
    assert "OutOfMemoryError" in row["error"] and "2.00 GiB" in row["error"]
    assert row["peak_allocated_bytes"] is __import__("pandas").NA  # no peak for an OOM row
    assert row["source"] == "dryrun"  # stand-in rows never pass for CUDA measurements


def test_a_killed_child_is_an_error_row_and_the_sweep_goes_on(tmp_path, monkeypatch):
    report, df = _collect(tmp_path, monkeypatch, "KillProbe", "[1, 2]")
    assert report.counts == {"error": 1, "ok": 1}
    err = df[df.outcome == "error"].iloc[0]
    assert "killed by SIGKILL" in err["error"]
    ok = df[df.outcome == "ok"].iloc[0]
    phases = __import__("json").loads(ok["phase_peaks_json"])
    # setup + 3 iterations x (forward, backward, optimizer)
    assert [p["phase"] for p in phases] == ["setup"] + ["forward", "backward", "optimizer"] * 3
    assert ok["params_total"] > 0 and ok["step_seconds"] > 0


def test_a_hung_child_is_killed_at_the_timeout(tmp_path, monkeypatch):
    start = time.monotonic()
    report, df = _collect(tmp_path, monkeypatch, "HangProbe", "[1]", timeout=4)
    assert report.counts == {"error": 1}
    assert "timed out after 4 s" in df.iloc[0]["error"]
    assert time.monotonic() - start < 120  # the 600 s sleep did not run out


def test_params_are_built_in_the_spec_dtype_and_state_bytes_are_counted(tmp_path, monkeypatch):
    """A config's own torch_dtype (float16 here, as llava-1.5-7b's) must not override the
    precision's parameter dtype. Expected bytes by hand: fp32 params 4 B each, AdamW's two fp32
    moments 8 B each plus one fp32 `step` scalar per parameter tensor (on the CPU, where this
    stand-in runs); bf16 params 2 B, SGD momentum one bf16 buffer 2 B."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridmem.harness import collect, load_dataset

    cfg = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
           "vocab_size": 64, "torch_dtype": "float16", "tie_word_embeddings": False}
    path = tmp_path / "llama16.json"
    path.write_text(json.dumps(cfg))
    sweep = tmp_path / "s.toml"
    sweep.write_text(f"""
[[block]]
model = ["{path}"]
seq_len = [16]
precision = ["fp32"]
optimizer = ["adamw"]
[[block]]
model = ["{path}"]
seq_len = [16]
precision = ["bf16"]
optimizer = ["sgd-momentum"]
""")
    monkeypatch.setenv("HYBRIDMEM_PROBE", "hybridmem.harness.probe:CpuProbe")
    out = tmp_path / "data"
    collect(sweep, out=out, backend="cuda", mlflow=False)
    df = load_dataset(out).set_index(["precision", "optimizer"])
    assert set(df["outcome"]) == {"ok"}
    with torch.device("meta"):
        tensors = len(list(AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**{k: v for k, v in cfg.items()})).parameters()))
    p = int(df["params_total"].iloc[0])
    assert df.loc[("fp32", "adamw"), "param_bytes"] == 4 * p
    assert df.loc[("fp32", "adamw"), "optimizer_state_bytes"] == 8 * p + 4 * tensors
    assert df.loc[("bf16", "sgd-momentum"), "param_bytes"] == 2 * p
    assert df.loc[("bf16", "sgd-momentum"), "optimizer_state_bytes"] == 2 * p
