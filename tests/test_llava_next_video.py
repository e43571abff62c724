"""LLaVA-NeXT-Video (`hybridmem/families/llava_next_video/`, one folder: a record and two
presets over the shared LLaVA architecture; docs/vlm-families.md).

Expected numbers come from the models themselves: parameter names and counts of
`LlavaNextVideoForConditionalGeneration` built on the meta device from the preset's config,
and the trace tier's run of the tiny preset for the analytic tier's peak.
"""

from __future__ import annotations

import pytest
import torch

from hybridmem import TrainingSpec
from hybridmem.analytic import estimate as analytic
from hybridmem.analytic.scope import refusal
from hybridmem.families import family
from hybridmem.families.common.images import image_plan
from hybridmem.models import load_config
from hybridmem.models.build import build_graph
from hybridmem.predict import choose_method
from hybridmem.trace import estimate as traced

TOL = 0.03  # tests/test_families.py TOL: analytic vs trace, peak allocated


def _meta_params(name: str) -> dict[str, int]:
    import transformers

    with torch.device("meta"):
        model = transformers.LlavaNextVideoForConditionalGeneration(load_config(name))
    return {n: p.numel() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["tiny-llava-next-video", "llava-next-video-7b"])
def test_graph_parameters_are_the_meta_device_models(name):
    want = _meta_params(name)
    graph = build_graph(TrainingSpec(model=name, micro_batch=1, seq_len=2048))
    assert graph.param_names() == want
    assert graph.num_params == sum(want.values())


def test_the_7b_preset_counts_by_part():
    # meta-device counts of the config class's defaults: CLIP ViT-L/14 up to layer -2 (23 of
    # its 24 layers run; transformers builds all 24), 1024 -> 4096 -> 4096 projector, a
    # Llama-2-7B-shaped LM with a 32000-token vocabulary
    want = _meta_params("llava-next-video-7b")
    parts = {"vision_tower": 0, "multi_modal_projector": 0, "image_newline": 0, "lm_head": 0,
             "language_model": 0}
    for n, c in want.items():
        part = next((p for p in parts if p in n), "language_model")
        parts[part] += c
    graph = build_graph(TrainingSpec(model="llava-next-video-7b", micro_batch=1, seq_len=2048))
    assert {m.name: m.num_params for m in graph.modules} == parts


def test_images_are_llava_next_s_anyres_tokens():
    """The same image rule as LLaVA-NeXT's on the same tower and pinpoints (its image path
    is modeling_llava_next.py's)."""
    video, nxt = load_config("tiny-llava-next-video"), load_config("tiny-llava-next")
    for size in (30, 60, 90):
        assert image_plan(video, size).tokens == image_plan(nxt, size).tokens
    assert family("llava_next_video").count_check


@pytest.mark.parametrize("kw", [dict(precision="bf16-mixed"),
                                dict(precision="bf16", train="lora", grad_ckpt=True)],
                         ids=["full-bf16-mixed", "lora-bf16-ckpt"])
def test_analytic_matches_trace_on_tiny(kw):
    spec = TrainingSpec(model="tiny-llava-next-video", micro_batch=2, seq_len=128, **kw)
    a, tr = analytic(spec), traced(spec)
    assert (a.params_total, a.params_trainable) == (tr.params_total, tr.params_trainable)
    rel = a.peak.allocated_bytes / tr.peak.allocated_bytes - 1
    assert abs(rel) <= TOL, f"analytic {a.peak.allocated_bytes} vs trace {tr.peak.allocated_bytes}"


def test_predict_picks_the_analytic_tier():
    spec = TrainingSpec(model="llava-next-video-7b", micro_batch=1, seq_len=2048, train="lora")
    assert refusal(spec) is None  # the analytic tier prices it: closed forms for every layer
    assert choose_method(spec).method in ("analytic", "hybrid")
