"""The CUDA harness runs the objectives beyond SFT with the trace tier's step functions
(`hybridmem.objectives.steps`), here through the CPU stand-in probe: DPO with the adapter-
disabled (LoRA) and the separate (full) reference, GRPO with its generation phase."""

from __future__ import annotations

import json

from test_harness_dryrun import collect_on_cpu

SWEEP = """
[sweep]
name = "objectives"
[[block]]
model = ["tiny-llama"]
micro_batch = [2]
seq_len = [32]
precision = ["fp32"]
train = ["lora", "full"]
objective = ["dpo"]
[[block]]
model = ["tiny-llama"]
micro_batch = [2]
seq_len = [264]
precision = ["bf16"]
train = ["lora"]
objective = ["grpo"]
num_generations = [2]
"""


def test_dpo_and_grpo_run_on_the_cpu_stand_in(tmp_path, monkeypatch):
    report = collect_on_cpu(SWEEP, tmp_path, monkeypatch)
    rows = {(r["objective"], r["train"]): r for r in report.rows}
    assert set(rows) == {("dpo", "lora"), ("dpo", "full"), ("grpo", "lora")}
    assert [r.get("error") for r in report.rows if r["outcome"] != "ok"] == []
    grpo = rows[("grpo", "lora")]
    assert grpo["num_generations"] == 2
    phases = {p["phase"] for p in json.loads(grpo["phase_peaks_json"])}
    assert "generation" in phases  # GRPO's completions, measured as their own phase
    dpo = {p["phase"] for p in json.loads(rows[("dpo", "full")]["phase_peaks_json"])}
    assert "generation" not in dpo


def test_multi_rank_objectives_are_refused_in_one_line():
    import pytest
    import torch

    from hybridmem import TrainingSpec
    from hybridmem.errors import SpecError
    from hybridmem.harness import distributed
    from hybridmem.job.parallel import ParallelSpec
    from hybridmem.models import load_config

    s = TrainingSpec(model="tiny-llama", micro_batch=2, seq_len=32, objective="dpo",
                     parallel=ParallelSpec(world_size=2, strategy="ddp"))
    with pytest.raises(SpecError, match="objective"):
        distributed.prepare(s, load_config(s.model), torch.device("cpu"))
