"""Several images per sample (`images_per_sample` 2) on every image family's tiny preset.

The batch (`families.common.images.text_inputs`, shared by the trace tier and the CUDA harness) lays the
images out as the family's chat template does: Qwen-VL wraps each image's tokens in
vision_start / vision_end (its M-RoPE `get_rope_index` reads one run of image tokens per
image grid), so a real forward runs. Oracles: a real (non-fake) CPU training step counting live
bytes (`test_trace.real_cpu_peak`; it fails outright when the model rejects the batch), the
model config's own token ids, and the trace tier (the analytic tier, 3 %).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridmem.errors import SpecError
from hybridmem.families.common.images import image_plan
from hybridmem.job.images import check_seq_len, image_token_id
from hybridmem.models import build_graph, load_config
from hybridmem.job.spec import TrainingSpec
from hybridmem.trace import runner
from test_qwen3_vl import ln_stats_bound
from test_trace import real_cpu_peak
from test_vlm_families import _analytic_within_3_percent

QWEN = {"tiny-qwen2-vl": "56x56", "tiny-qwen2.5-vl": "56x56", "tiny-qwen3-vl": "256x256"}
"""Small sizes the processors keep: 56x56 (min_pixels 56*56, 4 x 4 patches of 14, 4 tokens),
256x256 (Qwen3's min 65536 px, 16 x 16 patches of 16, 64 tokens)."""
OTHERS = ["tiny-llava", "tiny-llava-next", "tiny-llava-onevision", "tiny-llava-pixtral",
          "tiny-llava-siglip", "tiny-idefics3", "tiny-smolvlm", "tiny-gemma3", "tiny-internvl",
          "tiny-mistral3"]


def two_images(model: str, size=None, **kw) -> TrainingSpec:
    """2 images per sample and room for 8 text tokens beside them (and their markers)."""
    plan = image_plan(load_config(model), size)
    return TrainingSpec(**{"model": model, "micro_batch": 2, "images_per_sample": 2,
                           "image_size": size, "precision": "fp32",
                           "seq_len": 2 * (plan.tokens + plan.markers) + 8, **kw})


def runs(row: torch.Tensor, ident: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `ident` in a 1-D id row."""
    out, pos = [], 0
    for key, group in itertools.groupby(row.tolist(), lambda t: t == ident):
        n = len(list(group))
        if key:
            out.append((pos, n))
        pos += n
    return out


@pytest.mark.parametrize("model", OTHERS)
def test_a_real_cpu_step_runs_with_two_images(model):
    """The other families took 2 images in one run already (their models count image tokens,
    no per-image positions); the real step must run and keep bytes alive."""
    assert real_cpu_peak(two_images(model, micro_batch=1)) > 0


@pytest.mark.parametrize("model", [*QWEN, *(pytest.param(m, marks=pytest.mark.slow)
                                            for m in OTHERS)])
def test_trace_equals_a_real_cpu_run_with_two_images(model):
    spec = two_images(model, QWEN.get(model))
    tracker, job = runner.trace(spec, load_config(model), backend="meta")
    assert job.image_tokens == 2 * image_plan(load_config(model), spec.image_size).tokens
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(spec)


def test_qwen3_moe_runs_with_two_images():
    """bf16 only (its grouped-mm experts); the meta trace is above the real run by at most the
    vision LayerNorm statistics' width difference (test_qwen3_vl.ln_stats_bound)."""
    spec = two_images("tiny-qwen3-vl-moe", "256x256", precision="bf16", micro_batch=1)
    tracker, _ = runner.trace(spec, load_config(spec.model), backend="meta")
    gap = int(tracker.live_curve(device_only=False).max()) - real_cpu_peak(spec)
    assert 0 < gap <= ln_stats_bound(2 * 256), gap  # 2 images x 16 x 16 patches


@pytest.mark.parametrize("model", [*QWEN, "tiny-qwen3-vl-moe"])
def test_qwen_batch_wraps_each_image(model):
    """BOS, then per image: vision_start, its tokens, vision_end (Qwen2-VL chat template);
    the trace and harness batches are one; mm_token_type_ids marks exactly the image tokens."""
    from hybridmem.harness.workload import make_batch as harness_batch

    config = load_config(model)
    spec = two_images(model, QWEN.get(model, "256x256"))
    per = image_plan(config, spec.image_size).tokens
    batch, n_tok = runner.make_batch(spec, config, None, torch.float32)
    harness = harness_batch(spec, config, None, torch.device("cpu"))
    ids = batch["input_ids"][0]
    assert torch.equal(batch["input_ids"], harness["input_ids"])
    assert runs(ids, image_token_id(config)) == [(2, per), (2 + per + 2, per)] and n_tok == 2 * per
    start, end = config.vision_start_token_id, config.vision_end_token_id
    assert ids[[1, 2 + per, 3 + per, 4 + 2 * per]].tolist() == [start, end, start, end]
    assert torch.equal(batch["mm_token_type_ids"][0].bool(), ids == image_token_id(config))
    assert (batch["labels"][0] == -100).sum() == 2 * per


@pytest.mark.parametrize("model", [*QWEN, "tiny-llava"])
def test_seq_len_check_counts_the_markers(model):
    """Every tier refuses one token short of BOS + 2 x (tokens + markers) and takes that many;
    the analytic graph counts the image tokens the batch places."""
    config = load_config(model)
    size = QWEN.get(model)
    plan = image_plan(config, size)
    assert plan.markers == (2 if model in QWEN else 0)  # vision_start + vision_end
    fits = 1 + 2 * (plan.tokens + plan.markers)
    assert check_seq_len(fits, 2, plan) == 2 * plan.tokens
    spec = TrainingSpec(model=model, images_per_sample=2, image_size=size, seq_len=fits)
    batch, _ = runner.make_batch(spec, config, None, torch.float32)
    placed = int((batch["input_ids"][0] == image_token_id(config)).sum())
    assert build_graph(spec).image_tokens == placed == 2 * plan.tokens
    short = TrainingSpec(model=model, images_per_sample=2, image_size=size, seq_len=fits - 1)
    for tier in (build_graph, lambda s: runner.make_batch(s, config, None, torch.float32)):
        with pytest.raises(SpecError, match=rf"seq_len={fits - 1}: too short for 2 image"):
            tier(short)


@pytest.mark.parametrize("model", QWEN)
def test_qwen_analytic_within_3_percent_of_trace_with_two_images(model):
    _analytic_within_3_percent(two_images(model, QWEN[model], precision="bf16-mixed"))
