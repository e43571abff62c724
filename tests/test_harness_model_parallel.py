"""`hybridmem collect` on model-parallel layouts: the torchrun command it builds for a tp / cp
config, what a pipeline rank is built from, the one-line refusals (too few GPUs, expert
layouts, pp beside another axis), and (`slow`) one tp = 2 and one pp = 2 rank pair run for real
through torchrun on the CPU (gloo for NCCL; stand-in probes for CUDA: made-up per-rank numbers
for tp, each rank's live bytes counted for pp).

One lent GPU cannot measure any of these layouts (docs/parallel.md, "Measuring it"): each rank
needs its own GPU, so on this machine the ranks are CPU processes.
"""

from __future__ import annotations

import json
import sys

import pytest
from test_harness_multirank import MiB, _collect_sweep  # noqa: F401  (shared stand-ins)

from test_trace import DataPtrCounter

from hybridmem.errors import SpecError
from hybridmem.harness.probe import CpuProbe
from hybridmem.job.parallel import ParallelSpec


class CpuStorages(DataPtrCounter):
    """test_trace's live-bytes counter (storages by address, 512 B-rounded) on the CPU's
    storages only: the pipeline stage's example shapes are meta tensors (address 0, no
    memory)."""

    def _add(self, st) -> None:
        if st.device.type == "cpu":
            super()._add(st)


class LiveBytesProbe(CpuProbe):
    """A CPU rank's `torch.cuda.max_memory_allocated` stand-in: the live bytes of every
    storage an op made since the probe started (`CpuStorages`); each phase's peak counted from
    the bytes live at its start, as the CUDA probe resets the peak statistics."""

    source = "cpu-live-bytes"

    def init(self):
        import torch

        self.counter = CpuStorages([])
        self.counter.__enter__()
        return torch.device("cpu")

    def phase_start(self, phase: str, iteration: int) -> None:
        self.counter.peak = self.counter.current

    def phase_end(self, phase: str, iteration: int) -> dict:
        peak = self.counter.peak
        return {"allocated": peak, "reserved": peak, "active": peak, "inactive_split": 0,
                "device": peak}

    def close(self) -> None:
        self.counter.__exit__(None, None, None)

PP_SWEEP = """
[sweep]
name = "pp"
timeout_s = 300
[[block]]
model = ["tiny-llama"]
micro_batch = [2]
seq_len = [32]
precision = ["fp32"]
attn = ["eager"]
world_size = [2]
strategy = ["none"]
pp = [2]
pp_microbatches = [4]
pp_schedule = ["1f1b"]
"""
"""tests/test_parallel_pp_trace.py's job: tiny Llama, pp 2, 1F1B, 4 micro-batches of 2 x 32."""

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


def test_expert_and_mixed_pipeline_layouts_are_refused_in_one_line(tmp_path):
    from hybridmem.harness import load_sweep

    path = tmp_path / "s.toml"
    path.write_text(TP_SWEEP.format(tp=1, cp=1).replace("world_size = [2]", "world_size = [4]")
                    .replace("tp = [1]", "pp = [2]\nep = [2]\ndp_shard = [2]")
                    .replace('strategy = ["none"]', 'strategy = ["fsdp"]'))
    sweep = load_sweep(path)  # an impossible combination is dropped, its one line kept
    assert not sweep.items
    (reason,) = sweep.dropped
    assert reason.startswith("parallel.ep") and "tp (with sequence parallelism), cp" in reason
    from hybridmem.harness.ranks import check_measurable

    with pytest.raises(SpecError, match=r"parallel.tp.*with pp=2 the harness runs the "
                       "pipeline alone") as err:
        check_measurable(ParallelSpec(world_size=4, pp=2, tp=2), "sdpa")
    assert "\n" not in str(err.value)


def test_a_pipeline_rank_is_built_with_torchs_stage_and_schedule(tmp_path):
    """A pp = 2 (1F1B, 4 micro-batches) config is kept by the sweep and launched on 2 ranks;
    rank 1's job, built under torch's fake process group (building exchanges nothing), is
    torch's own `PipelineStage` (not the trace tier's `AloneStage`, which answers the start-up
    vote alone) holding the last stage of torchtitan's split, stepped by `Schedule1F1B`."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybridmem.harness import distributed, load_sweep
    from hybridmem.harness.runner import ranks_of
    from hybridmem.models.loader import load_config

    path = tmp_path / "s.toml"
    path.write_text(PP_SWEEP)
    (item,) = load_sweep(path).items
    assert ranks_of({"spec": item.spec.to_dict()}) == 2
    spec = item.spec.with_(model="tiny-llama")
    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        job = distributed.prepare(spec, load_config("tiny-llama"), torch.device("cpu"))
        schedule = job.pipeline.args[0]
        (stage,) = job.pipeline.args[1]
    finally:
        dist.destroy_process_group()
    assert type(stage) is PipelineStage and type(schedule) is Schedule1F1B
    assert (stage.stage_index, stage.num_stages, schedule._n_microbatches) == (1, 2, 4)
    kept = [type(m).__name__ for m in stage.submod.model.model.layers]
    assert kept == ["PipelineIdentityLayer", "LlamaDecoderLayer"]  # tiny-llama: 2 layers
    assert type(stage.submod.model.model.embed_tokens).__name__ == "PipelineIdentityLayer"
    # the step's batch: 4 micro-batches of 2 samples (`pp_microbatches` x `micro_batch`)
    assert tuple(job.batch["input_ids"].shape) == (8, 32)


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


@pytest.mark.slow  # two torchrun ranks on gloo, and the trace tier's two real-CPU ranks: ~30 s
def test_a_pipeline_rank_pair_runs_through_torchrun(tmp_path, monkeypatch):
    """pp = 2 (1F1B, 4 micro-batches of 2 x 32) on two gloo ranks, each rank's live bytes
    counted (`LiveBytesProbe`), against the trace tier's real-CPU pipeline oracle
    (tests/test_parallel_pp_trace.py: the same stages and schedule, one rank at a time under
    the fake process group, real tensors). Parameters agree exactly; each rank's peak is the
    oracle's plus what the fake process group and the trace tier's host category leave out:

    - one 512 B block per stage parameter (AdamW's `step` counters: CPU scalars, on CUDA too,
      `torch/optim/adam.py::_init_group` without `capturable` / `fused`; the trace tier labels
      them "host") and one more (`torch/distributed/pipelining/microbatch.py`'s import-time
      `sum_reducer = _LossReducer(torch.tensor(0.0), ...)`, made before the oracle's tracker
      starts);
    - on rank 0, one micro-batch's stage output (2 x 32 x 64 fp32): `Schedule1F1B` keeps the
      warm-up's first `send_work` list (waited, not dropped) until after its 1B1F loop
      (torch/distributed/pipelining/schedules.py, `_step_microbatches`), and gloo's send work
      holds the sent tensor (ProcessGroupGloo `SendWork::tensor_`), so micro-batch 0's output
      outlives its backward; the fake process group's work holds nothing. Rank 1 (one warm-up
      forward, whose send is fused into the 1B1F loop) has no such work."""
    from test_harness_runner import collect_with_probe

    from hybridmem.harness import load_dataset
    from hybridmem.parallel.trace_ranks import trace_rank

    report, out = collect_with_probe(tmp_path, monkeypatch,
                                     "test_harness_model_parallel:LiveBytesProbe", PP_SWEEP)
    df = load_dataset(out)
    assert report.counts == {"ok": 1}, df["error"].tolist()
    row = df.iloc[0]
    assert row["pp"] == 2 and row["world_size"] == 2
    ranks = json.loads(row["rank_peaks_json"])
    assert [r["rank"] for r in ranks] == [0, 1]
    (item,) = report.sweep.items
    spec = item.spec.with_(model="tiny-llama")
    oracle = [trace_rank(spec, r, backend="real") for r in (0, 1)]
    assert [r["param_bytes"] for r in ranks] == [o.param for o in oracle]
    # tiny-llama's decoder layer: 9 tensors (q, k, v, o, gate, up, down, 2 norms); stage 0
    # adds the embedding, stage 1 the final norm and lm_head (torchtitan's split of 2 layers)
    host = [512 * (10 + 1), 512 * (11 + 1)]
    pending_send = [spec.micro_batch * spec.seq_len * 64 * 4, 0]  # tiny-llama hidden 64, fp32
    expected = [o.peak()[0] + h + p for o, h, p in zip(oracle, host, pending_send)]
    assert [r["peak_allocated_bytes"] for r in ranks] == expected
    assert expected[0] > expected[1]  # 2 micro-batches in flight on rank 0, 1 on rank 1
