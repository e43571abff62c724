"""Qwen3-VL (docs/vlm-families.md): the image-token rule, the graph's parameters, the trace tier
against a real CPU run, the analytic tier against the trace tier; Qwen3-VL-MoE likewise.

Oracles: the model built by transformers on the meta device (parameter names and counts), a
real tiny model's `get_image_features` (image tokens), a real (non-fake) CPU run counting live
bytes (`test_trace.real_cpu_peak`), the trace tier (the analytic tier, 3 %).
"""

from __future__ import annotations

import pytest
import torch

from hybridmem.analytic import estimate as analytic
from hybridmem.errors import SpecError
from hybridmem.families.common.images import image_plan
from hybridmem.models import build_graph, load_config
from hybridmem.job.spec import TrainingSpec
from hybridmem.trace import estimate as trace_estimate, runner
from test_trace import real_cpu_peak
from test_vlm_families import _analytic_within_3_percent, _meta_model

TINY = "tiny-qwen3-vl"
SIZE = "256x288"  # the smallest sizes Qwen3-VL's processor keeps (>= 65536 px)


def ln_stats_bound(patches: int) -> int:
    """Most bytes the meta trace may exceed a real CPU run by on bf16 input (trace known
    limitation: layer_norm's mean and rstd in fp32 as on CUDA, bf16 in the CPU kernel), every
    vision LayerNorm's statistics alive at once, each rounded to 512 B blocks: 4 blocks x 2
    norms + the merger's over `patches` rows, the 2 DeepStack norms over patches / 4 rows."""
    from hybridmem.trace.tracker import round_size

    def diff(rows: int) -> int:
        return 2 * (round_size(rows * 4) - round_size(rows * 2))
    return 9 * diff(patches) + 2 * diff(patches // 4)


def tiny(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": TINY, "micro_batch": 2, "seq_len": 96, "image_size": SIZE,
                           **kw})


# --- the image-token rule --------------------------------------------------------------------

def test_qwen3_tokens_hand_count():
    """672x672 px, patch 16, merge 2: a 42 x 42 patch grid, 1764 patches, 441 tokens."""
    plan = image_plan(load_config("qwen3-vl-8b-instruct"), "672x672")
    assert (plan.size, plan.grid, plan.patches, plan.tokens) == ((672, 672), (1, 42, 42), 1764,
                                                                  441)


def test_qwen3_pixel_range_hand_cases():
    """Hand-derived with the published preprocessor's range [65536, 16777216] px, factor 32:
    64x96 (6144 px) scales up by sqrt(65536 / 6144) = 3.27 and ceils to 224x320 (Qwen2-VL's
    range keeps it near 56x84); 8192x8192 scales down by sqrt(8192² / 16777216) = 2 to
    4096x4096; 448x448 is kept."""
    cfg = load_config("qwen3-vl-2b-instruct")
    assert image_plan(cfg, "64x96").size == (224, 320)
    assert image_plan(cfg, "8192x8192").size == (4096, 4096)
    assert image_plan(cfg, "448x448").size == (448, 448)
    assert image_plan(load_config("qwen2-vl-2b-instruct"), "64x96").size == (56, 84)


def test_qwen3_every_tier_counts_the_same_image_tokens():
    """Graph, trace batch, harness batch and the real tiny model's `get_image_features`
    (pooled merger output rows, and every DeepStack level's rows)."""
    from hybridmem.harness.workload import make_batch as harness_batch
    import transformers

    spec = tiny(seq_len=256)
    config = load_config(TINY)
    rule = image_plan(config, SIZE).tokens
    graph = build_graph(spec).image_tokens
    _, traced = runner.make_batch(spec, config, None, torch.float32)
    harness = harness_batch(spec, config, None, torch.device("cpu"))
    placed = int((harness["input_ids"][0] == config.image_token_id).sum())
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    one = {"pixel_values": harness["pixel_values"][: image_plan(config, SIZE).patches],
           "image_grid_thw": harness["image_grid_thw"][:1]}
    with torch.no_grad():
        out = model.model.get_image_features(**one)
    by_model = torch.cat(list(out.pooler_output)).shape[0]
    deep = {torch.cat(list(f)).shape[0] for f in out.deepstack_features}
    assert rule == graph == traced == placed == by_model == 72 > 0  # 16 x 18 patches / 4
    assert deep == {rule} and len(out.deepstack_features) == 2


# --- parameters ------------------------------------------------------------------------------

@pytest.mark.parametrize("model", [TINY, "qwen3-vl-2b-instruct", "qwen3-vl-4b-instruct",
                                   "qwen3-vl-8b-instruct",
                                   "tiny-qwen3-vl-moe", "qwen3-vl-30b-a3b-instruct"])
def test_qwen3_params_equal_the_meta_model_per_tensor(model):
    ref = {k: p.numel() for k, p in _meta_model(model).named_parameters()}
    assert build_graph(TrainingSpec(model=model, seq_len=512)).param_names() == ref


@pytest.mark.parametrize("model, total, published", [
    # meta-device counts (transformers 5.24 on the meta device); the model pages' safetensors
    # counts: Qwen3-VL-2B-Instruct 2.13B, Qwen3-VL-4B-Instruct 4.44B, Qwen3-VL-8B-Instruct 8.77B
    ("qwen3-vl-2b-instruct", 2_127_532_032, 2.13), ("qwen3-vl-4b-instruct", 4_437_815_808, 4.44),
    ("qwen3-vl-8b-instruct", 8_767_123_696, 8.77)])
def test_qwen3_preset_totals(model, total, published):
    n = build_graph(TrainingSpec(model=model, seq_len=512)).num_params
    assert n == total and round(n / 1e9, 2) == published


def test_qwen3_moe_preset_total():
    """Meta-device count (transformers 5.24); Qwen3-VL-30B-A3B-Instruct's model page: 31.1B."""
    n = build_graph(TrainingSpec(model="qwen3-vl-30b-a3b-instruct", seq_len=512)).num_params
    assert n == 31_070_754_032 and round(n / 1e9, 1) == 31.1



def test_qwen3_bad_vision_field_is_one_line():
    import json

    from hybridmem.models.loader import load_config_dict

    _, data = load_config_dict(TINY)
    data["vision_config"]["patch_size"] = 0
    from hybridmem.models.light import config_from_dict
    with pytest.raises(SpecError, match=r"vision_config.patch_size=0: must be a positive"):
        config_from_dict(json.loads(json.dumps(data)))


def test_qwen3_parts_equal_the_meta_model():
    """Per part, by the module prefixes of transformers' tree (written out, not `part_of`):
    the merger and the DeepStack mergers are the projector."""
    parts = {"model.visual.merger.": "multi_modal_projector",
             "model.visual.deepstack_merger_list.": "multi_modal_projector",
             "model.visual.": "vision_tower", "lm_head": "lm_head"}
    ref: dict[str, int] = {}
    for name, p in _meta_model(TINY).named_parameters():
        part = next((v for k, v in parts.items() if name.startswith(k)), "language_model")
        ref[part] = ref.get(part, 0) + p.numel()
    for tier in (analytic, trace_estimate):
        pred = tier(tiny(micro_batch=1))
        assert {m.name: m.params for m in pred.modules} == ref


# --- the trace tier against a real CPU run -----------------------------------------------------

@pytest.mark.parametrize("kw", [dict(precision="fp32"),
                                dict(precision="bf16-mixed", train="llm+projector"),
                                pytest.param(dict(precision="bf16-mixed", train="lora"),
                                             marks=pytest.mark.slow)])
def test_qwen3_trace_equals_a_real_cpu_run(kw):
    spec = tiny(**kw)
    tracker, job = runner.trace(spec, load_config(spec.model), backend="meta")
    assert job.image_tokens == 72  # 16 x 18 patches / 4, hand count
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(spec)


@pytest.mark.slow
@pytest.mark.parametrize("model", [TINY, "tiny-qwen3-vl-moe"])
def test_qwen3_bf16_trace_above_a_real_cpu_run_by_layernorm_stats(model):
    """bf16 (the MoE's grouped-mm experts take bf16 only): the meta trace is above the real
    run by at most the vision LayerNorm statistics' width difference."""
    spec = tiny(model=model, precision="bf16")
    tracker, _ = runner.trace(spec, load_config(spec.model), backend="meta")
    gap = int(tracker.live_curve(device_only=False).max()) - real_cpu_peak(spec)
    assert 0 < gap <= ln_stats_bound(2 * 288), gap


# --- the analytic tier against the trace tier ------------------------------------------------

@pytest.mark.parametrize("kw", [dict(precision="fp32"),
                                pytest.param(dict(precision="bf16"), marks=pytest.mark.slow),
                                dict(precision="bf16-mixed", train="llm+projector"),
                                dict(precision="bf16", train="llm+projector", grad_ckpt=True),
                                dict(precision="bf16-mixed", train="lora")])
def test_qwen3_analytic_within_3_percent_of_trace(kw):
    _analytic_within_3_percent(tiny(**kw))


def test_qwen3_frozen_tower_saves_nothing_under_checkpointing():
    """The real model's vision tower has no `get_input_embeddings`, so gradient checkpointing's
    `enable_input_require_grads` leaves its output without grad: with LoRA nothing of the tower
    or the mergers is kept for backward (the analytic tier once kept 366 MB on qwen3-vl-2b)."""
    import transformers

    model = transformers.AutoModelForImageTextToText.from_config(load_config(TINY))
    with pytest.raises(NotImplementedError):
        model.model.visual.get_input_embeddings()
    acts = {m.name: m.activation for m in analytic(tiny(train="lora", grad_ckpt=True)).modules}
    assert acts["vision_tower"] == acts["multi_modal_projector"] == 0 < acts["language_model"]


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(model="qwen3-vl-2b-instruct", precision="bf16", train="llm+projector", grad_ckpt=True,
         micro_batch=2, seq_len=2048, image_size="672x672"),
    dict(model="qwen3-vl-2b-instruct", precision="bf16-mixed", train="lora", grad_ckpt=True,
         micro_batch=2, seq_len=2048, image_size="448x672")])
def test_qwen3_real_sized_analytic_within_3_percent(kw):
    spec = TrainingSpec(**kw)
    a, t = analytic(spec), trace_estimate(spec)
    assert abs(a.peak.allocated_bytes - t.peak.allocated_bytes) / t.peak.allocated_bytes <= 0.03


# --- Qwen3-VL-MoE --------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(micro_batch=2), pytest.param(
    dict(micro_batch=1, grad_ckpt=True), marks=pytest.mark.slow)])
def test_qwen3_moe_analytic_within_3_percent_of_trace(kw):
    """Qwen3-VL-MoE, full bf16 (the MoE closed forms' range, docs/families.md)."""
    _analytic_within_3_percent(tiny(model="tiny-qwen3-vl-moe", precision="bf16", **kw))


def test_qwen3_moe_lora_says_trace():
    from hybridmem.predict import predict

    with pytest.raises(SpecError, match="train='lora'.*use --method trace"):
        predict(tiny(model="tiny-qwen3-vl-moe", precision="bf16", train="lora"),
                method="analytic")
