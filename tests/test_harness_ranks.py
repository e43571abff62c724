"""The harness's torchrun protocol without launching anything: the command line, which file a
rank writes, and the per-field worst rank (`hybridmem/harness/ranks.py`). Real launches are in
tests/test_harness_multirank.py."""

from __future__ import annotations

import pytest

from hybridmem.errors import SpecError
from hybridmem.harness.ranks import rank_path, read, torchrun_command, worst_numbers


def test_torchrun_command_runs_the_module_on_n_local_ranks():
    cmd = torchrun_command("hybridmem.harness.child", 4, ["req.json", "res.json"], python="py")
    assert cmd == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                   "-m", "hybridmem.harness.child", "req.json", "res.json"]
    for bad in (0, True, 1.5):
        with pytest.raises(SpecError, match="nproc"):
            torchrun_command("m", bad)


def test_each_launched_rank_writes_its_own_file_and_read_finds_them(tmp_path, monkeypatch):
    for var in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    result = tmp_path / "r.json"
    assert rank_path(result) == result  # a plain process: the path itself
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert rank_path(result).name == "r.json.rank1"
    rank_path(result).write_text('{"rank": 1}')
    assert read(result, 2) == [None, {"rank": 1}]  # rank 0 wrote nothing


def test_worst_numbers_takes_the_max_of_fields_every_rank_reports():
    rows = [{"rank": 0, "max_allocated": 10, "outcome": "ok", "flag": True},
            {"rank": 1, "max_allocated": 12, "outcome": "ok", "flag": False, "extra": 1}]
    assert worst_numbers(rows) == {"rank": 1, "max_allocated": 12}
    assert worst_numbers([]) == {}


def test_workload_does_not_import_distributed_back():
    """distributed builds on workload; the child, not workload, dispatches a multi-rank spec
    (the two modules must not import each other)."""
    import ast
    from pathlib import Path

    import hybridmem.harness.workload as workload

    tree = ast.parse(Path(workload.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names] + [n.module or "" for n in ast.walk(tree)
                                  if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if "distributed" in n]
