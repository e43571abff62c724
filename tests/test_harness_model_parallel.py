"""`hybridmem collect` on model-parallel layouts: the torchrun command it builds for a tp / cp
config, the one-line refusals (too few GPUs, pipeline / expert layouts), and (`slow`) one tp = 2
rank pair run for real through torchrun on the CPU (gloo for NCCL, the stand-in probe for CUDA).

One lent GPU cannot measure any of these layouts (docs/parallel.md, "Measuring it"): each rank
needs its own GPU, so on this machine the ranks are CPU processes.
"""

from __future__ import annotations

import json
import sys

import pytest
from test_harness_multirank import MiB, _collect_sweep  # noqa: F401  (shared stand-ins)

from hybridmem.errors import SpecError
from hybridmem.job.parallel import ParallelSpec

TP_SWEEP = """
[sweep]
name = "tp"
timeout_s = 120
[[block]]
decoder = ["llama-tiny"]
seq_len = [16]
precision = ["fp32"]
attn = ["sdpa"]
world_size = [2]
strategy = ["none"]
tp = [{tp}]
cp = [{cp}]
"""


def test_the_torchrun_command_of_a_tp_config():
    """A tp = 2 request (no data-parallel strategy) launches 2 ranks of the child through
    torchrun's standalone rendezvous, the request and result paths as the child's arguments."""
    from hybridmem.harness.ranks import torchrun_command
    from hybridmem.harness.runner import CHILD, ranks_of
    from hybridmem.job.spec import TrainingSpec

    spec = TrainingSpec(model="llama-tiny", seq_len=16, parallel=ParallelSpec(world_size=2, tp=2))
    request = {"spec": spec.to_dict()}
    nproc = ranks_of(request)
    assert nproc == 2
    assert torchrun_command(CHILD, nproc, ["req.json", "res.json"]) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "hybridmem.harness.child", "req.json", "res.json"]


def test_too_few_gpus_is_one_line_naming_the_layout():
    from hybridmem.harness.ranks import check_gpus

    ps = ParallelSpec(world_size=16, tp=2, cp=2, pp=2, strategy="fsdp")
    with pytest.raises(SpecError) as err:
        check_gpus(ps, 1)
    line = str(err.value)
    assert "\n" not in line and "world_size=16" in line and "shows 1" in line
    assert "dp 2 x cp 2 x tp 2 x pp 2" in line
    check_gpus(ps, 16)  # enough GPUs
    check_gpus(ps, None)  # CPU ranks (gloo): any world size runs


def test_pipeline_and_expert_layouts_are_refused_in_one_line(tmp_path):
    from hybridmem.harness import load_sweep

    path = tmp_path / "s.toml"
    path.write_text(TP_SWEEP.format(tp=1, cp=1).replace("tp = [1]", "pp = [2]"))
    sweep = load_sweep(path)  # an impossible combination is dropped, its one line kept
    assert not sweep.items
    (reason,) = sweep.dropped
    assert reason.startswith("parallel.pp") and "tp (with sequence parallelism), cp" in reason


def test_a_sweep_no_config_of_which_fits_this_machine_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(SpecError, match=r"world_size=2: the layout \(dp 1 x cp 1 x tp 2 x pp 1\) "
                       "needs 2 GPUs, one per rank; this machine shows 1"):
        _collect_sweep(tmp_path, monkeypatch, "OneGpuProbe", TP_SWEEP.format(tp=2, cp=1))


@pytest.mark.slow  # two torchrun ranks on gloo: ~10-25 s on 2 shared cores
def test_a_tp_rank_pair_runs_through_torchrun(tmp_path, monkeypatch):
    """torchtitan's tp plan on two gloo ranks, measured by the child: each rank holds its
    column / row shards, so its parameter bytes are the tp rank's (`ranks._states`)."""
    from hybridmem.analytic.estimate import setup
    from hybridmem.models.loader import materialize_config
    from hybridmem.parallel import ranks
    from hybridmem.parallel.layout import rank_config

    report, df = _collect_sweep(tmp_path, monkeypatch, "RankProbe", TP_SWEEP.format(tp=2, cp=1))
    assert report.counts == {"ok": 1}, df["error"].tolist()
    row = df.iloc[0]
    assert row["tp"] == 2 and row["world_size"] == 2  # the recorded layout columns
    assert [r["rank"] for r in json.loads(row["rank_peaks_json"])] == [0, 1]
    (item,) = report.sweep.items  # the sweep's llama-tiny: its config as the child built it
    narrow = materialize_config(json.dumps(rank_config(item.config, 2, 1)))
    tp_spec = item.spec.with_(model=materialize_config(json.dumps(item.config)))
    layers = [(p.module, p.layer) for p in setup(tp_spec.with_(
        model=narrow, parallel=ParallelSpec()))[1]]
    assert row["param_bytes"] == ranks._states(tp_spec, layers).param
