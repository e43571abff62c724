"""The real build/train path of the CUDA runner, on CPU, across precisions, optimizers, trains.

Slow (one fresh process per config): run with `pytest -m slow tests/test_harness_dryrun.py`.
It catches runner bugs (autocast, GradScaler, master weights, LoRA, checkpointing, SigLIP)
before a GPU lease is spent on them.
"""

from __future__ import annotations

import json

import pytest

SWEEP = """
[sweep]
name = "dryrun"
[vision.siglip-tiny]
model_type = "siglip_vision_model"
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
patch_size = 6
image_size = 30
[[block]]
sampling = "random"
samples = 8
seed = 3
vision = ["siglip-tiny", "clip-tiny", "none"]
decoder = ["llama-tiny"]
gqa = [false, true]
micro_batch = [2]
seq_len = [64]
images_per_sample = [1, 2]
precision = ["fp32", "bf16", "bf16-mixed", "fp16-mixed", "bf16-master"]
optimizer = ["adamw", "adamw-fused", "sgd-momentum", "adafactor"]
train = ["full", "llm+projector", "projector", "lora"]
attn = ["eager", "sdpa"]
grad_ckpt = [true, false]
"""


def collect_on_cpu(text: str, tmp_path, monkeypatch):
    """`collect --backend cuda` of sweep `text` through the CPU stand-in probe."""
    from hybridmem.harness import collect

    monkeypatch.setenv("HYBRIDMEM_PROBE", "hybridmem.harness.probe:CpuProbe")
    sweep = tmp_path / "s.toml"
    sweep.write_text(text)
    return collect(sweep, out=tmp_path / "data", backend="cuda", mlflow=False)


@pytest.mark.slow
def test_every_sampled_config_trains_on_the_cpu_stand_in(tmp_path, monkeypatch):
    report = collect_on_cpu(SWEEP, tmp_path, monkeypatch)
    errors = [(r["model_name"], r["precision"], r["optimizer"], r["train"], r["error"])
              for r in report.rows if r["outcome"] != "ok"]
    assert len(report.rows) == 8  # `samples = 8`: every sampled config ran
    assert not errors
    for r in report.rows:
        assert len(json.loads(r["phase_peaks_json"])) == 1 + 3 * 3
        assert 0 < r["params_trainable"] <= r["params_total"]


LOOP_SWEEP = """
[sweep]
name = "dryrun-loop"
[[block]]
model = ["tiny-llama"]
micro_batch = [2]
seq_len = [64]
precision = ["fp16-mixed", "bf16-master"]
loop = ["custom"]
max_grad_norm = [1.0]
grad_accum = [2]
"""


@pytest.mark.slow
def test_loop_axes_train_on_the_cpu_stand_in(tmp_path, monkeypatch):
    report = collect_on_cpu(LOOP_SWEEP, tmp_path, monkeypatch)
    assert [r["error"] for r in report.rows if r["outcome"] != "ok"] == []
    assert len(report.rows) == 2
    for r in report.rows:
        assert (r["loop"], r["max_grad_norm"], r["grad_accum"]) == ("custom", 1.0, 2)
        # setup + 3 iterations x (2 forward/backward micro-steps + the step)
        assert len(json.loads(r["phase_peaks_json"])) == 1 + 3 * (2 * 2 + 1)
