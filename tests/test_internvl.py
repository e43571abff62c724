"""InternVL (docs/vlm-families.md "InternVL"): the image rule, parameters per part, each tier.

Oracles: transformers' own tiling function (`get_optimal_tiled_canvas`, the PIL image
processor's tile count), the model built on the meta device (parameter names and counts; the
HF model pages' totals), a real tiny model's `get_image_features` (image tokens), a real
(non-fake) CPU run counting live bytes (the trace tier), and the trace tier (the analytic
tier, 3 %).
"""

from __future__ import annotations

import re

import pytest
import torch

from hybridmem.analytic import estimate as analytic
from hybridmem.errors import SpecError
from hybridmem.families.common.images import image_plan
from hybridmem.models import build_graph, load_config
from hybridmem.families.internvl.model import optimal_grid
from hybridmem.job.spec import TrainingSpec
from hybridmem.trace import estimate as trace_estimate, runner
from test_trace import real_cpu_peak
from test_vlm_families import TINY_KW, _analytic_within_3_percent, _gemma3_vision_analytic, \
    _gemma3_vision_real, _meta_model, _parts_equal_the_meta_model

TINY = "tiny-internvl"
PRESETS = ("internvl3-1b-hf", "internvl3-2b-hf", "internvl3-8b-hf")


# --- the image rule -------------------------------------------------------------------------

def test_grid_matches_transformers():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        get_optimal_tiled_canvas as ref,
    )

    for h, w in [(448, 448), (800, 800), (1000, 1000), (1400, 1400), (300, 1200), (1080, 1920),
                 (2000, 500), (64, 64)]:
        assert optimal_grid(h, w, 448) == ref((h, w), (448, 448), 1, 12)


@pytest.mark.parametrize("side", [448, 633, 634, 896, 950, 951, 1344, 3000])
def test_tiles_match_the_image_processor(side):
    """GotOcr2ImageProcessorPil.get_number_of_image_patches with the published processor's
    size (448) and InternVLProcessor's crop_to_patches=True."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        GotOcr2ImageProcessorPil,
    )

    proc = GotOcr2ImageProcessorPil(size={"height": 448, "width": 448})
    want = proc.get_number_of_image_patches(side, side, {"crop_to_patches": True})
    assert image_plan(load_config("internvl3-2b-hf"), side).crops == want


@pytest.mark.parametrize("side, tiles", [
    # hand counts, 448-px tiles, squares tie on 1x1 / 2x2 / 3x3: the larger grid wins while
    # side² > half its area: 2x2 from side² > 2·448² (side ≥ 634), 3x3 from > 4.5·448² (951)
    (None, 1), (448, 1), (633, 1), (634, 5), (896, 5), (950, 5), (951, 10), (2000, 10)])
def test_tiles_hand_count(side, tiles):
    plan = image_plan(load_config("internvl3-8b-hf"), side)
    assert (plan.crops, plan.tokens) == (tiles, 256 * tiles)  # image_seq_length 256


@pytest.mark.parametrize("hw", [(448, 896), (300, 1200), (1080, 1920), (2000, 500),
                                (700, 1000)])
def test_hxw_tiles_match_the_image_processor(hw):
    """`--image-size HxW`: the tiles the PIL image processor really cuts from an (H, W) image
    (published size 448, InternVLProcessor's crop_to_patches=True), and its own count."""
    import numpy as np
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        GotOcr2ImageProcessorPil,
    )

    proc = GotOcr2ImageProcessorPil(size={"height": 448, "width": 448})
    cut = proc(images=np.zeros((*hw, 3), np.uint8), crop_to_patches=True,
               return_tensors="pt")["pixel_values"].shape[0]
    want = proc.get_number_of_image_patches(*hw, {"crop_to_patches": True})
    plan = image_plan(load_config("internvl3-2b-hf"), f"{hw[0]}x{hw[1]}")
    assert plan.crops == cut == want and plan.tokens == 256 * want  # image_seq_length 256


def test_hxw_hand_count():
    """448x896: ratio 2, the 2x1 grid (columns x rows) exactly, + thumbnail = 3 tiles; 896x448
    the 1x2 grid, the same count; the old square-only rule read 448 (1 tile)."""
    for hw in ("448x896", "896x448"):
        assert image_plan(load_config("internvl3-8b-hf"), hw).crops == 3


def test_image_seq_length_must_match_the_tower():
    import copy
    from hybridmem.families.internvl.model import image_plan as rule

    cfg = copy.deepcopy(load_config(TINY))
    cfg.image_seq_length = 5
    with pytest.raises(SpecError, match=r"image_seq_length=5: .* gives 4 tokens \(valid: 4\)"):
        rule(cfg, (56, 56))


def test_every_tier_counts_the_same_image_tokens():
    """Analytic graph, trace batch and CUDA-harness batch read one rule; the real tiny model's
    `get_image_features` on the harness's pixel inputs agrees."""
    import transformers
    from hybridmem.harness.workload import make_batch as harness_batch

    spec = TrainingSpec(model=TINY, micro_batch=2, seq_len=128, image_size=112)
    config = load_config(spec.model)
    rule = image_plan(config, 112)
    graph = build_graph(spec)
    _, traced = runner.make_batch(spec, config, None, torch.float32)
    harness = harness_batch(spec, config, None, torch.device("cpu"))
    placed = int((harness["input_ids"][0] == config.image_token_id).sum())
    assert harness["pixel_values"].shape == (2 * 5, 3, 56, 56)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():
        feats = model.model.get_image_features(harness["pixel_values"][:5]).pooler_output
    by_model = feats.numel() // config.text_config.hidden_size
    # 112 px: 2 x 2 tiles of 56 px + thumbnail, 4 x 4 patches shuffled to 2 x 2 tokens each
    assert rule.tokens == graph.image_tokens == traced == placed == by_model == 20
    assert graph.vision_batch == 10


# --- parameters -----------------------------------------------------------------------------

@pytest.mark.parametrize("model", (TINY,) + PRESETS)
def test_params_equal_the_meta_model_per_tensor(model):
    ref = {k: p.numel() for k, p in _meta_model(model).named_parameters()}
    assert build_graph(TrainingSpec(model=model, seq_len=4096)).param_names() == ref


@pytest.mark.parametrize("model, total, page", [
    # meta-device counts; HF model pages (safetensors) of OpenGVLab/InternVL3-*-hf
    ("internvl3-1b-hf", 938_193_024, "938M"), ("internvl3-2b-hf", 2_088_957_440, "2.09B"),
    ("internvl3-8b-hf", 7_944_373_760, "7.94B")])
def test_preset_totals(model, total, page):
    assert build_graph(TrainingSpec(model=model, seq_len=4096)).num_params == total
    assert (f"{total / 1e6:.0f}M" if total < 1e9 else f"{total / 1e9:.2f}B") == page


def test_parts_equal_the_meta_model():
    _parts_equal_the_meta_model(TINY, {"model.multi_modal_projector.": "multi_modal_projector",
                                       "model.vision_tower.": "vision_tower",
                                       "lm_head": "lm_head"}, image_size=56)


def _variant(tmp_path, top: dict | None = None, **vision) -> str:
    """tiny-internvl with other vision_config / top-level values, as a config.json path."""
    import json

    from hybridmem.models.loader import load_config_dict

    d = load_config_dict(TINY)[1]
    d["vision_config"].update(vision)
    d.update(top or {})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    return str(path)


@pytest.mark.parametrize("top, vision, field", [
    (dict(vision_feature_layer=-2), {}, "vision_feature_layer=-2"),
    ({}, dict(hidden_dropout_prob=0.1), "vision_config.hidden_dropout_prob=0.1")])
def test_unpriced_settings_are_refused_by_the_analytic_tier(tmp_path, top, vision, field):
    path = _variant(tmp_path, top, **vision)
    with pytest.raises(SpecError, match=rf"{re.escape(field)}: .*--method trace"):
        build_graph(TrainingSpec(model=path, seq_len=64, image_size=56))


# --- trace tier and analytic tier -----------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(precision="fp32"),
                                dict(precision="bf16-mixed", train="llm+projector"),
                                dict(precision="bf16-mixed", train="lora"),
                                dict(precision="bf16", grad_ckpt=True)])
def test_trace_equals_a_real_cpu_run(kw):
    """(bf16 + checkpointing is exact here, unlike tiny Qwen2-VL / Idefics3's +1024 B: the
    peak is not where recomputed vision LayerNorm statistics are alive.)"""
    spec = TrainingSpec(model=TINY, micro_batch=2, seq_len=64, image_size=112, **kw)
    tracker, job = runner.trace(spec, load_config(spec.model), backend="meta")
    assert job.image_tokens == 20  # 2 x 2 tiles + thumbnail, 4 tokens each (hand count above)
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(spec)


@pytest.mark.parametrize("kw", [dict(precision="fp32"), dict(precision="bf16-mixed")])
def test_hxw_trace_equals_a_real_cpu_run_and_analytic_within_3_percent(kw):
    """56x112 on 56-px tiles: the 2x1 grid + thumbnail, 3 tiles of 4 tokens (hand count)."""
    spec = TrainingSpec(model=TINY, micro_batch=2, seq_len=64, image_size="56x112", **kw)
    tracker, job = runner.trace(spec, load_config(spec.model), backend="meta")
    assert job.image_tokens == 12 and build_graph(spec).vision_batch == 2 * 3
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(spec)
    _analytic_within_3_percent(spec)


@pytest.mark.parametrize("kw", TINY_KW + [dict(precision="bf16-mixed")])
def test_analytic_within_3_percent_of_trace(kw):
    spec = TrainingSpec(model=TINY, micro_batch=2, seq_len=64, image_size=112, **kw)
    _analytic_within_3_percent(spec)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    # the README command's job (backward peak), the tower training on 2 x 10 tiles at
    # 951 px (backward), bf16-mixed with 5 tiles per sample (backward)
    dict(model="internvl3-2b-hf", micro_batch=4, seq_len=4096, train="lora", grad_ckpt=True),
    dict(model="internvl3-1b-hf", micro_batch=1, seq_len=8192, image_size=951,
         images_per_sample=2, precision="bf16"),
    dict(model="internvl3-1b-hf", micro_batch=2, seq_len=4096, image_size=896,
         precision="bf16-mixed")])
def test_real_sized_analytic_within_3_percent(kw):
    """Measured: docs/vlm-families.md "InternVL" (all within 0.001 %)."""
    spec = TrainingSpec(**kw)
    a, t = analytic(spec), trace_estimate(spec)
    assert abs(a.peak.allocated_bytes - t.peak.allocated_bytes) / t.peak.allocated_bytes <= 0.03


# --- the vision side's closed forms against a real CPU forward ------------------------------

def _mid_config(**vision):
    """internvl3-1b-hf's vision side (448-px tiles, 1025 tokens, width 1024, projector to
    896) with 2 InternViT layers and a 1-layer LM: real-sized widths, CPU-sized depth."""
    import json
    from hybridmem.models.loader import load_config_data, load_config_dict

    d = load_config_dict("internvl3-1b-hf")[1]
    d["vision_config"].update(num_hidden_layers=2, **vision)
    d["text_config"].update(num_hidden_layers=1, vocab_size=1024)
    d.update(image_token_id=1000)
    return load_config_data(d)


def _cuda_minus_cpu(cfg, n: int, dtype, tower: bool) -> int:
    """What the closed forms (CUDA's kernels) keep beyond the CPU run, by hand: fp32 SDPA on
    CUDA is the mem-efficient kernel, whose logsumexp rows are padded to 32 (the CPU kernel's
    are not); on bf16 input CUDA's LayerNorm keeps fp32 mean/rstd, the CPU kernel bf16 ones
    (tests/test_vlm_families.py LN_STATS)."""
    from hybridmem.allocator.alloc import t as block

    vc = cfg.vision_config
    T = (vc.image_size[0] // vc.patch_size[0]) ** 2 + 1
    layers, heads = vc.num_hidden_layers, vc.num_attention_heads
    out = 0
    if tower and dtype == torch.float32:
        out += layers * (block(n * heads * -(-T // 32) * 32, 4) - block(n * heads * T, 4))
    if dtype == torch.bfloat16:
        ln = 2 * layers if tower and vc.norm_type == "layer_norm" else 0  # RMSNorm: exact
        rows = [n * T] * ln + [n * (T - 1) // 4]  # + the projector's LayerNorm
        out += sum(2 * (block(r, 4) - block(r, 2)) for r in rows)
    return out


@pytest.mark.parametrize("config, dtype, e, tower", [
    ("tiny", torch.float32, 4, True), ("tiny", torch.float32, 4, False),
    *[pytest.param("mid", *case, marks=pytest.mark.slow)  # ~8 s each on 2 busy cores
      for case in [(torch.float32, 4, True), (torch.float32, 4, False),
                   (torch.bfloat16, 2, True), (torch.bfloat16, 2, False)]]])
def test_vision_activations_equal_a_real_cpu_forward(config, dtype, e, tower):
    """Tower + projector, saved for backward and held by `image_outputs`: the closed forms
    equal a real CPU forward up to the hand-derived CUDA-vs-CPU kernel differences (measured:
    mid fp32 with the tower +7,168 B, bf16 +34,816 B / +2,048 B; the rest 0)."""
    cfg = _mid_config() if config == "mid" else load_config(TINY)
    from hybridmem.families.internvl.model import vision_modules

    want = _gemma3_vision_real(cfg, 2, dtype, tower) + _cuda_minus_cpu(cfg, 2, dtype, tower)
    assert _gemma3_vision_analytic(cfg, 2, e, tower, vision_modules) == want


# InternViT-6B's options (InternVL3-38B / 78B towers): RMSNorm and q/k norms, on tiny-internvl
OPTIONS = dict(norm_type="rms_norm", use_qk_norm=True)


@pytest.mark.parametrize("kw", [dict(precision="fp32"), dict(precision="bf16-mixed")])
def test_norm_options_trace_equals_a_real_cpu_run(tmp_path, kw):
    spec = TrainingSpec(model=_variant(tmp_path, **OPTIONS), micro_batch=2, seq_len=64,
                        image_size=112, **kw)
    tracker, _ = runner.trace(spec, load_config(spec.model), backend="meta")
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(spec)


@pytest.mark.parametrize("kw", [dict(precision="fp32"), dict(precision="bf16"),
                                dict(precision="bf16-mixed")])
def test_norm_options_analytic_within_3_percent_of_trace(tmp_path, kw):
    spec = TrainingSpec(model=_variant(tmp_path, **OPTIONS), micro_batch=2, seq_len=64,
                        image_size=112, **kw)
    _analytic_within_3_percent(spec)


@pytest.mark.parametrize("config", ["tiny", pytest.param("mid", marks=pytest.mark.slow)])
@pytest.mark.parametrize("options", [dict(norm_type="rms_norm"), dict(use_qk_norm=True)])
@pytest.mark.parametrize("dtype, e", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_norm_options_vision_activations_equal_a_real_cpu_forward(tmp_path, config, options,
                                                                  dtype, e):
    """Exact on both (mid: InternVL3-1B widths, measured 0 B apart after the kernel
    differences, docs/vlm-families.md)."""
    from hybridmem.families.internvl.model import vision_modules

    cfg = (_mid_config(**options) if config == "mid"
           else load_config(_variant(tmp_path, **options)))
    want = _gemma3_vision_real(cfg, 2, dtype, True) + _cuda_minus_cpu(cfg, 2, dtype, True)
    assert _gemma3_vision_analytic(cfg, 2, e, True, vision_modules) == want


# --- the light config -----------------------------------------------------------------------


@pytest.mark.parametrize("vision, message", [
    (dict(image_size=[448]), "vision_config.image_size=[448]: must be a positive integer or"),
    (dict(hidden_size=30), "vision_config.hidden_size=30: not a multiple of num_attention_heads=4"),
    (dict(num_hidden_layers=0), "vision_config.num_hidden_layers=0: must be a positive")])
def test_light_config_refuses_bad_vision_fields_in_one_line(tmp_path, vision, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        build_graph(TrainingSpec(model=_variant(tmp_path, **vision), seq_len=64))


@pytest.mark.slow
def test_harness_collects_with_images_on_the_cpu_stand_in(tmp_path, monkeypatch):
    """The CUDA harness's child (CPU stand-in probe) builds, freezes and trains tiny-internvl
    with the rule's pixel inputs: every row ok, its image tokens and parameter counts the
    analytic tier's."""
    from hybridmem.harness import collect, load_dataset

    sweep = tmp_path / "s.toml"
    sweep.write_text(f'[[block]]\nmodel = ["{TINY}"]\nseq_len = [64]\nmicro_batch = [2]\n'
                     'image_size = [112]\nprecision = ["bf16"]\ntrain = ["lora", "llm+projector"]\n')
    monkeypatch.setenv("HYBRIDMEM_PROBE", "hybridmem.harness.probe:CpuProbe")
    collect(sweep, out=tmp_path / "data", backend="cuda", mlflow=False)
    df = load_dataset(tmp_path / "data").set_index("train")
    assert set(df["outcome"]) == {"ok"}
    for train in ("lora", "llm+projector"):
        a = analytic(TrainingSpec(model=TINY, micro_batch=2, seq_len=64, image_size=112,
                                  precision="bf16", train=train))
        row = df.loc[train]
        assert (row["image_tokens"], row["params_total"], row["params_trainable"]) == (
            20, a.params_total, a.params_trainable)


# --- the CLI --------------------------------------------------------------------------------

@pytest.mark.slow  # ~15 s: the fit searches (world size, micro-batch) run too
def test_the_user_command_prices_on_the_analytic_tier(capsys):
    """The brief's command (docs/vlm-families.md "InternVL"), as JSON."""
    import json
    from hybridmem.cli import main

    assert main(["predict", "--model", "internvl3-2b-hf", "--micro-batch", "4", "--seq-len",
                 "4096", "--train", "lora", "--grad-ckpt", "--gpu", "a100-40gb", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "analytic"
    assert any("256 of the 4096 tokens per sample are image tokens" in n for n in out["notes"])


def test_the_learned_features_read_internvl_sizes():
    """The hybrid tier's features take InternVL's [h, w] image and patch sizes (a crash in
    `spec_features` before): 448 / 14 -> 32 x 32 patches per image."""
    from hybridmem.learned.features import config_features, spec_features
    from hybridmem.models.loader import load_config_dict

    _, data = load_config_dict("internvl3-2b-hf")
    assert config_features(data)["vision_image_size"] == 448
    assert spec_features(TrainingSpec(model="internvl3-2b-hf"), data)["image_tokens"] == 1024
