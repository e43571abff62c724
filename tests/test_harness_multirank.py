"""Multi-rank configs through the real torchrun path, on the CPU: gloo stands in for NCCL and a
stand-in probe for CUDA (imported by every rank from this file through PYTHONPATH).

Each launch starts torchrun and two ranks (~14 s on 2 cores), so the configs here are few.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
import uuid
from pathlib import Path

import pandas as pd
import pytest
from test_harness_runner import collect_with_probe

from hybridmem.errors import SpecError
from hybridmem.harness import load_dataset, load_sweep
from hybridmem.harness.probe import CpuProbe
from hybridmem.harness.ranks import NO_RESULT, merge
from hybridmem.harness.store import measured_keys

MiB = 2**20

SWEEP = """
[sweep]
name = "multirank"
timeout_s = {timeout}
[[block]]
decoder = ["llama-tiny"]
seq_len = [16]
precision = ["fp32"]
world_size = [2]
strategy = {strategies}
"""


def _rank() -> int:
    return int(os.environ.get("RANK", 0))


class RankProbe(CpuProbe):
    """Per-rank numbers that tell the ranks apart: rank r peaks at (r + 1) MiB allocated in its
    backward phases, reserved one MiB above that, device one more."""

    PHASE = {"setup": 0, "forward": 1, "backward": 3, "optimizer": 2}

    def phase_end(self, phase: str, iteration: int) -> dict:
        alloc = (_rank() + 1) * MiB * self.PHASE[phase] // 3
        return {"allocated": alloc, "reserved": alloc + MiB, "active": alloc,
                "inactive_split": 0, "device": alloc + 2 * MiB}


class OneGpuProbe(CpuProbe):
    """A machine with a single GPU."""

    def environment(self) -> dict:
        return {**super().environment(), "device_count": 1}


class HungRankProbe(CpuProbe):
    """Rank 1 hangs in its first forward (a deadlocked kernel); rank 0 then waits in DDP's
    gradient all-reduce."""

    def phase_start(self, phase: str, iteration: int) -> None:
        if phase == "forward" and _rank() == 1:
            time.sleep(600)


class DeadRankProbe(CpuProbe):
    """Rank 1 dies by SIGKILL while building (as the kernel's OOM killer would do)."""

    def phase_start(self, phase: str, iteration: int) -> None:
        if phase == "setup" and _rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def _collect_sweep(tmp_path, monkeypatch, probe: str, sweep: str, **options):
    """`collect` of `sweep` with this file's stand-in probe `probe`: the report and rows."""
    report, out = collect_with_probe(tmp_path, monkeypatch, f"test_harness_multirank:{probe}",
                                     sweep, **options)
    return report, load_dataset(out) if out.exists() else None


def _collect(tmp_path, monkeypatch, probe: str, strategies: list[str], resume: bool = False,
             record_history: bool = False, timeout: float = 120):
    return _collect_sweep(tmp_path, monkeypatch, probe,
                          SWEEP.format(strategies=json.dumps(strategies), timeout=timeout),
                          resume=resume, record_history=record_history)


def test_ddp_and_fsdp_rows_carry_both_ranks_and_resume_adds_nothing(tmp_path, monkeypatch):
    report, df = _collect(tmp_path, monkeypatch, "RankProbe", ["ddp", "fsdp"],
                          record_history=True)
    assert report.counts == {"ok": 2}, df["error"].tolist()
    assert sorted(df["strategy"]) == ["ddp", "fsdp"] and set(df["world_size"]) == {2}
    for _, row in df.iterrows():
        ranks = json.loads(row["rank_peaks_json"])
        assert [r["rank"] for r in ranks] == [0, 1]
        assert [r["peak_allocated_bytes"] for r in ranks] == [MiB, 2 * MiB]  # RankProbe
        # the row is the worst rank (rank 1): its peaks and the phase of its peak
        assert row["peak_allocated_bytes"] == 2 * MiB
        assert row["peak_reserved_bytes"] == 3 * MiB and row["peak_device_bytes"] == 4 * MiB
        assert row["peak_phase"] == "backward"
        snapshots = tmp_path / "data" / f"{row['history_path']}.rank1"
        assert row["history_path"] and snapshots.is_file()  # one allocator history per rank
    by = df.set_index("strategy")
    # FSDP2 shards every parameter along dim 0 over 2 ranks; every llama-tiny parameter has an
    # even dim 0 (vocab 128, hidden 64, intermediate 128), so each rank holds exactly half of
    # what a DDP replica holds (bytes counted per rank by the child)
    assert by.loc["fsdp", "param_bytes"] * 2 == by.loc["ddp", "param_bytes"]
    assert by.loc["ddp", "params_total"] == by.loc["fsdp", "params_total"]  # whole-model count

    again, df2 = _collect(tmp_path, monkeypatch, "RankProbe", ["ddp", "fsdp"], resume=True)
    assert again.skipped == 2 and not again.rows
    assert len(df2) == 2 and len(measured_keys(tmp_path / "data")) == 2


def test_a_rank_that_dies_is_an_error_row_naming_it(tmp_path, monkeypatch):
    report, df = _collect(tmp_path, monkeypatch, "DeadRankProbe", ["ddp"])
    assert report.counts == {"error": 1}
    row = df.iloc[0]
    assert "rank 1 died: killed by SIGKILL" in row["error"]
    assert row["peak_allocated_bytes"] is pd.NA
    assert {r["outcome"] for r in json.loads(row["rank_peaks_json"])} == {NO_RESULT}


def _rank_result(outcome: str, alloc: int | None, ended: float, error: str = "") -> dict:
    return {"outcome": outcome, "error": error, "peak_allocated_bytes": alloc,
            "peak_reserved_bytes": alloc, "peak_phase": "forward", "ended_at": ended,
            "iteration_seconds": [1.0, 2.0]}


def test_merge_any_oom_makes_an_oom_job():
    """The OOM of one rank decides the job even when a peer failed earlier in the collective
    it left (the peer's error is a consequence)."""
    out = merge([_rank_result("error", None, 1.0, "gloo: connection closed"),
                 _rank_result("oom", None, 2.0, "OutOfMemoryError: 2 GiB")])
    assert out["outcome"] == "oom" and out["error"] == "rank 1: OutOfMemoryError: 2 GiB"
    assert [r["outcome"] for r in out["rank_peaks"]] == ["error", "oom"]


def test_merge_first_error_partial_and_ok():
    first = merge([_rank_result("error", None, 5.0, "late"), _rank_result("error", None, 3.0, "first")])
    assert first["error"] == "rank 1: first"
    partial = merge([_rank_result("ok", 7, 1.0), None], failure="timed out after 9 s")
    assert partial["outcome"] == "error"
    assert partial["error"] == "timed out after 9 s; no result from rank(s) [1]"
    slow = {**_rank_result("ok", 9, 1.0), "iteration_seconds": [0.5, 3.0], "peak_phase": "backward"}
    ok = merge([_rank_result("ok", 7, 1.0), slow])
    assert ok["outcome"] == "ok" and ok["peak_allocated_bytes"] == 9
    assert ok["peak_phase"] == "backward"  # the phase of the worst rank's peak
    assert ok["iteration_seconds"] == [1.0, 3.0]  # the slowest rank per iteration


def test_sweep_parallel_axis_is_validated(tmp_path):
    path = tmp_path / "s.toml"
    head = '[[block]]\ndecoder = ["llama-tiny"]\nseq_len = [16]\n'
    path.write_text(head + 'world_size = [1, 2]\nstrategy = ["none", "ddp", "fsdp"]\n'
                    "parallel = { bucket_cap_mb = 50 }\n")
    sweep = load_sweep(path)
    got = sorted((i.spec.parallel.world_size, i.spec.parallel.strategy) for i in sweep.items)
    # (1, fsdp) shards nothing and (2, none) has no strategy: ParallelSpec refuses both
    assert got == [(1, "ddp"), (1, "none"), (2, "ddp"), (2, "fsdp")]
    assert sum(sweep.dropped.values()) == 2
    assert {i.spec.parallel.bucket_cap_mb for i in sweep.items} == {50}
    for body, match in [('world_size = [2]\n', r"block\[0\].strategy=None"),
                        ('world_size = [0]\nstrategy = ["ddp"]\n', r"block\[0\].world_size=0"),
                        ('world_size = [2]\nstrategy = ["dp"]\n', r"block\[0\].strategy='dp'"),
                        ('world_size = [2]\nstrategy = ["ddp"]\nparallel = { bucket_cap_mb = -1 }\n',
                         r"block\[0\].parallel.bucket_cap_mb=-1"),
                        ('world_size = [2]\nstrategy = ["ddp"]\nparallel = { nope = 1 }\n',
                         r"block\[0\].parallel.nope=1: unknown key")]:
        path.write_text(head + body)
        with pytest.raises(SpecError, match=match):
            load_sweep(path)


def test_deepspeed_config_follows_the_parallel_spec():
    """Every ZeRO knob is passed through; bf16-master is DeepSpeed's bf16 (bf16 params, fp32
    master partitions, as the LLaVA recipe runs)."""
    from hybridmem.harness.distributed import deepspeed_config
    from hybridmem.job.parallel import ParallelSpec
    from hybridmem.job.spec import TrainingSpec

    ps = ParallelSpec(world_size=4, strategy="zero3", offload_optimizer="cpu",
                      reduce_bucket_size=1234)
    cfg = deepspeed_config(TrainingSpec(model="x", micro_batch=3, precision="bf16-master",
                                        parallel=ps))
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["reduce_bucket_size"] == 1234
    assert zero["offload_optimizer"] == {"device": "cpu"} and "offload_param" not in zero
    assert zero["overlap_comm"] is True  # DeepSpeed's default for stage 3 (ParallelSpec.overlap)
    assert cfg["train_batch_size"] == 12 and cfg["train_micro_batch_size_per_gpu"] == 3
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    fp32 = deepspeed_config(TrainingSpec(model="x", precision="fp32",
                                         parallel=ParallelSpec(world_size=2, strategy="zero1")))
    assert fp32["zero_optimization"]["stage"] == 1 and not fp32["bf16"]["enabled"]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed")
def test_zero3_ranks_hold_half_the_params_and_their_masters(tmp_path, monkeypatch):
    """ZeRO-3 over 2 ranks through DeepSpeed (on gloo). Expected bytes by hand: llama-tiny has
    P = 2 x 128 x 64 (embeddings, lm_head) + 2 x (4 x 64^2 + 3 x 64 x 128 + 2 x 64) + 64
    = 98,624 parameters; each rank holds P/2 fp32 params, and as state P/2 x (4 B fp32 master
    + 8 B AdamW moments) + one 4 B `step` scalar (one flat partition, on the CPU here)."""
    report, df = _collect(tmp_path, monkeypatch, "RankProbe", ["zero3"])
    assert report.counts == {"ok": 1}, df["error"].tolist()
    row = df.iloc[0]
    p = 98_624
    assert row["params_total"] == p  # the whole model, though each rank holds half
    assert row["param_bytes"] == 4 * p // 2
    assert row["optimizer_state_bytes"] == 12 * p // 2 + 4


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None,
                    reason="DeepSpeed is installed")
def test_zero_without_deepspeed_is_an_unavailable_error():
    from hybridmem.harness.distributed import deepspeed_job
    from hybridmem.harness.workload import Unavailable
    from hybridmem.job.parallel import ParallelSpec
    from hybridmem.job.spec import TrainingSpec

    spec = TrainingSpec(model="x", parallel=ParallelSpec(world_size=2, strategy="zero2"))
    with pytest.raises(Unavailable, match="strategy='zero2' needs DeepSpeed"):
        deepspeed_job(spec, None, None)


def test_configs_needing_more_gpus_than_the_machine_has_are_not_run(tmp_path, monkeypatch):
    """A sweep none of whose configs this machine can launch is a one-line error, before
    anything is launched (configs beside runnable ones are counted as not run)."""
    with pytest.raises(SpecError, match="needs 2 GPUs, one per rank; this machine shows 1"):
        _collect(tmp_path, monkeypatch, "OneGpuProbe", ["ddp"])
    assert not (tmp_path / "data").exists()


def test_parts_written_before_the_parallel_columns_read_as_single_process(tmp_path):
    from hybridmem.harness.schema import COLUMNS
    from hybridmem.harness.store import append_rows, load_dataset

    row = {c: 1 for c, kind in COLUMNS.items() if kind == "int64"}
    append_rows(tmp_path, [{**row, "grad_ckpt": False, "spec_hash": "a", "collected_at": "t",
                            "source": "cuda", "gpu_name": "g", "torch_version": "v"}])
    old = next(tmp_path.glob("part-*.parquet"))
    pd.read_parquet(old).drop(columns=["strategy", "rank_peaks_json"]).to_parquet(old)
    df = load_dataset(tmp_path)
    assert df.loc[0, "strategy"] == "none" and df.loc[0, "rank_peaks_json"] == ""


def _processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment holds `marker` (Linux /proc)."""
    pids = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in env.read_bytes():
                pids.append(int(env.parent.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_a_hung_rank_times_out_and_no_rank_is_left_behind(tmp_path, monkeypatch):
    marker = f"HYBRIDMEM_TEST_MARK={uuid.uuid4().hex}"
    monkeypatch.setenv(*marker.split("="))
    report, df = _collect(tmp_path, monkeypatch, "HungRankProbe", ["ddp"], timeout=30)
    assert report.counts == {"error": 1}
    assert df.iloc[0]["error"].startswith("timed out after 30 s")
    assert _processes_with(marker) == []  # torchrun and both ranks are gone
