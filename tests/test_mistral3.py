"""Mistral-3 (Pixtral tower + Mistral LM; docs/vlm-families.md "Mistral-3") per tier.

Oracles: the model transformers builds on the meta device (parameter names and counts per
tensor and per part), a real tiny model's `get_image_features` (image tokens), hand counts of
the processor's rule, a real (non-fake) CPU run counting live bytes (the trace tier), and the
trace tier (the analytic tier, 3 %).
"""

from __future__ import annotations

import pytest

from hybridmem.errors import SpecError
from hybridmem.families.common.images import image_plan
from hybridmem.job.images import check_seq_len
from hybridmem.models import build_graph, load_config
from hybridmem.job.spec import TrainingSpec
from hybridmem.trace import runner
from test_trace import real_cpu_peak
from test_vlm_families import (
    _analytic_within_3_percent, _meta_model, _parts_equal_the_meta_model,
)

TINY = "tiny-mistral3"
REAL = "mistral-small-3.1-24b-instruct-2503"
# LLaVA with a Pixtral tower (pixtral-12b): the same tower and rule, no merger, LLaVA's projector
LLAVA_TINY, LLAVA_REAL = "tiny-llava-pixtral", "pixtral-12b"


# --- the image-token rule -------------------------------------------------------------------

@pytest.mark.parametrize("size, tokens, markers, resized", [
    # hand counts of PixtralImageProcessor + PixtralProcessor with patch 14 x merge 2 = 28 px,
    # longest_edge 1540: below the edge each side is ceiled to 28 px; above it both sides are
    # floored after dividing by the ratio, then ceiled
    ("1024x1024", 37 * 37, 37, (1036, 1036)),   # ceil(1024 / 28) = 37
    (None, 55 * 55, 55, (1540, 1540)),          # default: a longest-edge square, 1540 / 28 = 55
    ("2000x1000", 55 * 28, 55, (1540, 784)),    # ratio 2000/1540: 1540 x 770 -> 55 x 28 rows/cols
    (448, 16 * 16, 16, (448, 448)),
    ("768x1024", 28 * 37, 28, (784, 1036)),
])
def test_pixtral_tokens_hand_count(size, tokens, markers, resized):
    plan = image_plan(load_config(REAL), size)
    assert (plan.tokens, plan.markers, plan.size) == (tokens, markers, resized)


def test_pixtral_rule_matches_the_processor():
    """The processor's own resize (its PIL backend's copy: no torchvision needed) and count."""
    import numpy as np
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        get_resize_output_image_size)

    config = load_config(REAL)
    for h, w in [(1024, 1024), (2000, 1000), (30, 45), (1540, 1541), (700, 3000)]:
        ref = get_resize_output_image_size(np.zeros((h, w, 3)), size=(1540, 1540),
                                           patch_size=(28, 28))
        plan = image_plan(config, f"{h}x{w}")
        assert plan.size == tuple(ref)
        # PixtralProcessor._get_num_multimodal_tokens: (cols + 1) * rows positions per image
        assert plan.tokens + plan.markers == (ref[1] // 28 + 1) * (ref[0] // 28)


def test_seq_len_counts_break_tokens():
    plan = image_plan(load_config(TINY), "112x84")  # 4 x 3 tokens + 4 [IMG_BREAK]/[IMG_END]
    assert check_seq_len(17, 1, plan) == 12
    with pytest.raises(SpecError, match=r"seq_len=16: too short for 1 image\(s\) of 12 image "
                       r"tokens and 4 marker tokens"):
        check_seq_len(16, 1, plan)
    with pytest.raises(SpecError, match=r"image_size='112x'"):
        build_graph(TrainingSpec(model=TINY, image_size="112x"))


# one count across the tiers and the tiny model's `get_image_features`:
# tests/test_vlm_families.py test_every_tier_counts_the_same_image_tokens (FAMILIES)


# --- parameters -----------------------------------------------------------------------------

@pytest.mark.parametrize("model", [TINY, REAL, LLAVA_TINY, LLAVA_REAL])
def test_params_equal_the_meta_model_per_tensor(model):
    ref = {k: p.numel() for k, p in _meta_model(model).named_parameters()}
    assert build_graph(TrainingSpec(model=model, seq_len=8192)).param_names() == ref


@pytest.mark.parametrize("model, total, billions", [(REAL, 24_011_361_280, 24.0),
                                                    (LLAVA_REAL, 12_682_739_712, 12.7)])
def test_preset_totals(model, total, billions):
    # the model pages (https://huggingface.co/mistralai/Mistral-Small-3.1-24B-Instruct-2503:
    # 24B; https://huggingface.co/mistral-community/pixtral-12b: 12.7B); the meta-device model
    # (oracle) has exactly `total`
    built = build_graph(TrainingSpec(model=model, seq_len=8192)).num_params
    assert built == sum(p.numel() for p in _meta_model(model).parameters()) == total
    assert round(total / 1e9, 1) == billions


def test_pixtral_llava_tokens_hand_count():
    """pixtral-12b: patch 16, no merge, longest edge 1024: 1024 px = 64 x 64 tokens + 64
    breaks; 2048x1000 -> ratio 2: 1024 x 500 -> 64 x ceil(500 / 16) = 32 (512 px)."""
    config = load_config(LLAVA_REAL)
    assert (image_plan(config).tokens, image_plan(config).markers) == (4096, 64)
    plan = image_plan(config, "2048x1000")
    assert (plan.tokens, plan.markers, plan.size) == (64 * 32, 64, (1024, 512))


def test_parts_equal_the_meta_model():
    """Per part, by the prefixes of transformers' module tree (written out, not `part_of`)."""
    _parts_equal_the_meta_model(TINY, {"model.vision_tower.": "vision_tower",
                                       "model.multi_modal_projector.": "multi_modal_projector",
                                       "lm_head": "lm_head"}, image_size="56x84")


# --- trace == a real CPU run; analytic within 3 % of the trace ------------------------------

@pytest.mark.parametrize("kw", [
    dict(precision="fp32"), dict(precision="bf16-mixed", train="llm+projector"),
    # 10-20 s each on 2 shared cores: outside the default run (equal when last run, docs)
    pytest.param(dict(precision="bf16-mixed", train="lora"), marks=pytest.mark.slow),
    pytest.param(dict(precision="bf16", grad_ckpt=True), marks=pytest.mark.slow)])
def test_trace_equals_a_real_cpu_run(kw):
    spec = TrainingSpec(model=TINY, micro_batch=2, seq_len=64, image_size="112x84", **kw)
    tracker, job = runner.trace(spec, load_config(spec.model), backend="meta")
    assert job.image_tokens == 12  # 4 x 3 merged patches per image, hand count
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(spec)


@pytest.mark.parametrize("kw", [dict(precision="bf16-mixed"),
                                pytest.param(dict(precision="fp32"), marks=pytest.mark.slow)])
def test_pixtral_llava_trace_equals_a_real_cpu_run(kw):
    spec = TrainingSpec(model=LLAVA_TINY, micro_batch=2, seq_len=128, image_size="128x96", **kw)
    tracker, job = runner.trace(spec, load_config(spec.model), backend="meta")
    assert job.image_tokens == 48  # 8 x 6 patches of 16 px per image, hand count
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(spec)


@pytest.mark.parametrize("kw", [dict(precision="fp32"), dict(precision="bf16"),
                                dict(precision="bf16-mixed"),
                                dict(precision="bf16-mixed", train="llm+projector"),
                                dict(precision="bf16", grad_ckpt=True),
                                dict(precision="bf16-mixed", train="lora"),
                                # the tower's blocks in the op-level policy's cached set and
                                # its linears quantised, as the LM's (analytic/sac.py,
                                # LayerKind.linear)
                                dict(precision="bf16", grad_ckpt=True, grad_ckpt_policy="ops"),
                                dict(precision="bf16-mixed", train="lora", quantize="nf4")])
def test_analytic_within_3_percent_of_trace(kw):
    if kw.get("quantize"):
        pytest.importorskip("bitsandbytes")
    # 224x168 px: 16 x 12 patches, 48 tokens + 8 markers per image; the vision side is a
    # larger share of the tiny model's memory than at 112x84
    _analytic_within_3_percent(TrainingSpec(model=TINY, micro_batch=2, seq_len=128,
                                            image_size="224x168", **kw))


@pytest.mark.parametrize("kw", [dict(precision="bf16-mixed"),
                                dict(precision="bf16", grad_ckpt=True),
                                dict(precision="bf16-mixed", train="lora")])
def test_pixtral_llava_analytic_within_3_percent_of_trace(kw):
    _analytic_within_3_percent(TrainingSpec(model=LLAVA_TINY, micro_batch=2, seq_len=128,
                                            image_size="128x96", **kw))


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(train="lora", grad_ckpt=True),
    dict(train="lora", precision="bf16"),
])
def test_real_sized_analytic_within_3_percent(kw):
    _analytic_within_3_percent(TrainingSpec(model=REAL, micro_batch=1, seq_len=4096,
                                            image_size="1024x1024", **kw))


HARNESS_SWEEP = """
[sweep]
name = "dryrun-pixtral"
[[block]]
model = ["tiny-mistral3", "tiny-llava-pixtral"]
micro_batch = [2]
seq_len = [128]
image_size = [96]
precision = ["bf16-mixed", "fp32"]
train = ["full", "lora"]
grad_ckpt = [true]
"""


@pytest.mark.slow
def test_harness_trains_both_pixtral_families_on_the_cpu_stand_in(tmp_path, monkeypatch):
    """The CUDA runner's real build/train path with the harness batch (`image_sizes` a tensor)."""
    from test_harness_dryrun import collect_on_cpu

    report = collect_on_cpu(HARNESS_SWEEP, tmp_path, monkeypatch)
    assert [r["error"] for r in report.rows if r["outcome"] != "ok"] == []
    # 96 px: ceil(96 / 28) = 4 -> 16 tokens (Mistral-3); 96 / 16 = 6 -> 36 (pixtral LLaVA)
    assert {(r["model_name"], r["image_tokens"]) for r in report.rows} == {
        ("tiny-mistral3", 16), ("tiny-llava-pixtral", 36)}
    assert len(report.rows) == 8
