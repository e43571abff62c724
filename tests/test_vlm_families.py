"""VLM families with closed forms (docs/vlm-families.md): the one image-token rule, Qwen2-VL and
Qwen2.5-VL per tier.

Oracles: the model built by transformers on the meta device (parameter names and counts), the
model's own `get_image_features` on a real tiny model (image tokens), a real (non-fake) CPU
run counting live bytes (the trace tier), and the trace tier (the analytic tier, 3 %).
"""

from __future__ import annotations

import pytest
import torch

from hybridmem.analytic import estimate as analytic
from hybridmem.errors import SpecError
from hybridmem.job.images import check_seq_len, image_plan, smart_resize
from hybridmem.models import build_graph, load_config
from hybridmem.spec import TrainingSpec
from hybridmem.trace import estimate as trace_estimate, runner
from test_trace import real_cpu_peak

QWEN = ("tiny-qwen2-vl", "tiny-qwen2.5-vl")
# (preset, image_size) per family with an image rule and a tiny preset
FAMILIES = [("tiny-llava", None), ("tiny-llava-next", 45), ("tiny-qwen2-vl", "112x168"),
            ("tiny-qwen2.5-vl", "112x168")]


def _meta_model(model: str):
    import transformers

    with torch.device("meta"):
        m = transformers.AutoModelForImageTextToText.from_config(load_config(model))
    m.tie_weights()
    return m


# --- the one image-token rule ---------------------------------------------------------------

@pytest.mark.parametrize("model, size", FAMILIES)
def test_every_tier_counts_the_same_image_tokens(model, size):
    """Analytic graph, trace batch and CUDA-harness batch read one rule; the model itself
    (a real tiny model's `get_image_features` on the harness's pixel inputs) agrees."""
    from hybridmem.harness.workload import make_batch as harness_batch
    import transformers

    spec = TrainingSpec(model=model, micro_batch=2, seq_len=256, image_size=size)
    config = load_config(model)
    rule = image_plan(config, size).tokens
    graph = build_graph(spec).image_tokens
    batch, traced = runner.make_batch(spec, config, None, torch.float32)
    harness = harness_batch(spec, config, None, torch.device("cpu"))
    placed = int((harness["input_ids"][0] == (getattr(config, "image_token_id", None)
                                              or config.image_token_index)).sum())
    torch.manual_seed(0)
    model_ = transformers.AutoModelForImageTextToText.from_config(config)
    one = {k: v[:1] for k, v in harness.items() if k in ("pixel_values", "image_sizes")}
    if "image_grid_thw" in harness:
        one = {"pixel_values": harness["pixel_values"][: image_plan(config, size).patches],
               "image_grid_thw": harness["image_grid_thw"][:1]}
    with torch.no_grad():
        feats = model_.model.get_image_features(**one).pooler_output
    feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
    by_model = feats.numel() // config.get_text_config().hidden_size
    assert rule == graph == traced == placed == by_model > 0


def test_seq_len_check_is_one_rule():
    plan = image_plan(load_config("tiny-llava"))  # 25 tokens (preset _source)
    assert check_seq_len(26, 1, plan) == 25
    with pytest.raises(SpecError, match=r"seq_len=25: too short for 1 image\(s\) of 25"):
        check_seq_len(25, 1, plan)
    for tier in (build_graph, lambda s: runner.make_batch(s, load_config(s.model), None,
                                                           torch.float32)):
        with pytest.raises(SpecError, match=r"seq_len=25: too short"):
            tier(TrainingSpec(model="tiny-llava", seq_len=25))


def test_smart_resize_matches_transformers():
    tv = pytest.importorskip("torchvision")  # noqa: F841 - transformers' module needs it
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as ref

    for h, w in [(448, 448), (100, 3000), (2000, 4000), (30, 40), (1080, 1920)]:
        assert smart_resize(h, w, 28) == ref(h, w, 28)


def test_smart_resize_hand_cases():
    """Hand-derived: 448x672 are multiples of 28 within the pixel range (unchanged); 30x40 is
    below 56*56 px, scaled up by sqrt(3136/1200) and ceiled to multiples of 28 -> 56x84."""
    assert smart_resize(448, 672, 28) == (448, 672)
    assert smart_resize(30, 40, 28) == (56, 84)


def test_image_size_forms():
    assert TrainingSpec(model="tiny-qwen2-vl", image_size="448x448").image_size == 448
    assert TrainingSpec(model="tiny-qwen2-vl", image_size="448X672").image_size == "448x672"
    with pytest.raises(SpecError, match=r"image_size='448x'"):
        TrainingSpec(model="tiny-qwen2-vl", image_size="448x")
    with pytest.raises(SpecError, match=r"image_size='30x45': HxW needs a native-resolution"):
        build_graph(TrainingSpec(model="tiny-llava", image_size="30x45"))


def test_qwen_tokens_hand_count():
    """448x672 px, patch 14, merge 2: a 32 x 48 patch grid, 1536 patches, 384 tokens."""
    plan = image_plan(load_config("qwen2-vl-7b-instruct"), "448x672")
    assert (plan.grid, plan.patches, plan.tokens) == ((1, 32, 48), 1536, 384)


# --- Qwen2-VL / Qwen2.5-VL per tier ---------------------------------------------------------

@pytest.mark.parametrize("model", QWEN + ("qwen2-vl-2b-instruct", "qwen2.5-vl-7b-instruct"))
def test_qwen_params_equal_the_meta_model_per_tensor(model):
    ref = {k: p.numel() for k, p in _meta_model(model).named_parameters()}
    assert build_graph(TrainingSpec(model=model, seq_len=512)).param_names() == ref


@pytest.mark.parametrize("model, total", [
    # HF model pages' safetensors counts of the published checkpoints
    ("qwen2-vl-2b-instruct", 2_208_985_600), ("qwen2-vl-7b-instruct", 8_291_375_616),
    ("qwen2.5-vl-3b-instruct", 3_754_622_976), ("qwen2.5-vl-7b-instruct", 8_292_166_656)])
def test_qwen_preset_totals(model, total):
    assert build_graph(TrainingSpec(model=model, seq_len=512)).num_params == total


@pytest.mark.parametrize("model", QWEN)
def test_qwen_parts_equal_the_meta_model(model):
    """Per part, by the module prefixes of transformers' tree (written out, not `part_of`)."""
    parts = {"model.visual.merger.": "multi_modal_projector", "model.visual.": "vision_tower",
             "lm_head": "lm_head"}
    ref: dict[str, int] = {}
    for name, p in _meta_model(model).named_parameters():
        part = next((v for k, v in parts.items() if name.startswith(k)), "language_model")
        ref[part] = ref.get(part, 0) + p.numel()
    for tier in (analytic, trace_estimate):
        pred = tier(TrainingSpec(model=model, micro_batch=1, seq_len=64, image_size="56x84"))
        assert {m.name: m.params for m in pred.modules} == ref


@pytest.mark.parametrize("model", QWEN)
@pytest.mark.parametrize("kw", [dict(precision="fp32"),
                                dict(precision="bf16-mixed", train="llm+projector"),
                                dict(precision="bf16", train="llm+projector", grad_ckpt=True)])
def test_qwen_trace_equals_a_real_cpu_run(model, kw, request):
    """(bf16-mixed with checkpointing is not compared: the real CPU run's recompute loses the
    CUDA fp32 LayerNorm rule, `corrections.cuda_autocast_rules`, and torch refuses it.)"""
    if model == "tiny-qwen2-vl" and kw.get("grad_ckpt"):
        request.applymarker(pytest.mark.xfail(strict=True, reason="known: the meta trace is "
                                              "1024 B (two blocks) above the real run; cause "
                                              "not found yet (docs/vlm-families.md)"))
    spec = TrainingSpec(model=model, micro_batch=2, seq_len=64, image_size="112x168", **kw)
    tracker, job = runner.trace(spec, load_config(spec.model), backend="meta")
    assert job.image_tokens == 24  # 2 x (8 x 12 patches / 4) tokens, hand count
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(spec)


@pytest.mark.parametrize("model", QWEN)
@pytest.mark.parametrize("kw", [dict(precision="fp32"), dict(precision="bf16"),
                                dict(precision="bf16-mixed"),
                                dict(precision="bf16", train="llm+projector", grad_ckpt=True),
                                dict(precision="bf16-mixed", train="lora")])
def test_qwen_analytic_within_3_percent_of_trace(model, kw):
    spec = TrainingSpec(model=model, micro_batch=2, seq_len=64, image_size="112x168", **kw)
    a, t = analytic(spec), trace_estimate(spec)
    assert a.params_total == t.params_total and a.params_trainable == t.params_trainable
    ta = a.peak.allocated_bytes - a.breakdown["workspace"]
    tt = t.peak.allocated_bytes - t.breakdown["workspace"]
    assert abs(ta - tt) / tt <= 0.03, (ta, tt)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(model="qwen2-vl-2b-instruct", precision="bf16", train="llm+projector", grad_ckpt=True,
         micro_batch=2, seq_len=1024, image_size="448x672"),
    dict(model="qwen2.5-vl-3b-instruct", precision="bf16", grad_ckpt=True, micro_batch=1,
         seq_len=1024, image_size="448x672")])
def test_qwen_real_sized_analytic_within_3_percent(kw):
    spec = TrainingSpec(**kw)
    a, t = analytic(spec), trace_estimate(spec)
    assert abs(a.peak.allocated_bytes - t.peak.allocated_bytes) / t.peak.allocated_bytes <= 0.03
