"""The multi-rank launch path of `hybridmem collect`, with a CPU/gloo stand-in for NCCL."""

from __future__ import annotations

import textwrap

import pytest

from hybridmem.errors import SpecError
from hybridmem.parallel.launch import launch_ranks, rank_path, summarize_ranks, torchrun_command

# Each rank builds a replica, all-reduces its grads over gloo and reports its own numbers.
RANK_SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from hybridmem.parallel.launch import write_rank_result
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Linear(64, 32)
    model(torch.randn(4, 64)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    write_rank_result({"rank": rank, "world_size": world, "rank_sum": total.item(),
                       "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())})
    dist.destroy_process_group()
""")


def test_torchrun_command():
    cmd = torchrun_command("run.py", 4, ["--spec", "x.json"], python="py")
    assert cmd == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                   "run.py", "--spec", "x.json"]
    assert torchrun_command("hybridmem.harness.child", 2, ["req", "res"], python="py",
                            module=True)[-4:] == ["-m", "hybridmem.harness.child", "req", "res"]
    with pytest.raises(SpecError, match="nproc=0"):
        torchrun_command("run.py", 0)


def test_two_gloo_ranks_report_back(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    results = launch_ranks(script, 2, timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 and r["rank_sum"] == 1.0 for r in results)  # 0 + 1
    assert all(r["param_bytes"] == (64 * 32 + 32) * 4 for r in results)  # fp32 Linear(64, 32)


def test_failed_rank_is_reported(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("import sys; sys.exit(3)\n")
    with pytest.raises(RuntimeError, match="torchrun exited"):
        launch_ranks(script, 2, timeout_s=120)


def test_rank_path(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert str(rank_path("r.json")) == "r.json"
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "3")
    assert str(rank_path("r.json")) == "r.json.rank3"


def test_summarize_ranks_takes_the_worst_rank():
    rows = [{"rank": 0, "max_allocated": 10, "outcome": "ok"},
            {"rank": 1, "max_allocated": 12, "outcome": "ok", "extra": 1}]
    out = summarize_ranks(rows)
    assert out["max_allocated"] == 12 and out["world_size"] == 2 and out["per_rank"] == rows
    assert "extra" not in out and "outcome" not in out
