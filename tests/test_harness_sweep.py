"""Sweep files: grid and seeded random expansion, budgets, run order, errors that name the field."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from hybridmem.errors import SpecError
from hybridmem.harness.order import space_filling_order
from hybridmem.harness.sweep import load_sweep

REPO = Path(__file__).resolve().parents[1]
SWEEPS = REPO / "datasets" / "sweeps"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return path


GRID = """
[sweep]
name = "t"
[[block]]
vision = ["clip-tiny"]
decoder = ["llama-tiny"]
gqa = [false, true]
micro_batch = [1, 2, 4]
seq_len = [64]
precision = ["fp32", "bf16"]
"""


def test_grid_is_the_product_of_the_axes(tmp_path):
    sweep = load_sweep(_write(tmp_path, GRID))
    # 2 gqa x 3 micro-batches x 2 precisions, all feasible (25 image tokens < 64)
    assert len(sweep.items) == 12
    assert len({it.spec_hash for it in sweep.items}) == 12
    assert {it.spec.micro_batch for it in sweep.items} == {1, 2, 4}
    gqa = [it.config["text_config"]["num_key_value_heads"] for it in sweep.items]
    assert Counter(gqa) == {4: 6, 1: 6}  # llama-tiny: 4 heads; GQA groups of 4 -> 1 KV head
    assert all(it.image_tokens == 25 for it in sweep.items)  # (30 / 6)^2 patches, CLS dropped


def test_random_sampling_is_seeded_and_distinct(tmp_path):
    text = GRID.replace("[[block]]", '[[block]]\nsampling = "random"\nsamples = 5\nseed = 7')
    a = load_sweep(_write(tmp_path, text))
    b = load_sweep(_write(tmp_path, text))
    c = load_sweep(_write(tmp_path, text.replace("seed = 7", "seed = 8")))
    assert len(a.items) == 5 and len({it.spec_hash for it in a.items}) == 5
    assert [it.spec_hash for it in a.items] == [it.spec_hash for it in b.items]
    assert {it.spec_hash for it in a.items} != {it.spec_hash for it in c.items}


def test_max_configs_keeps_a_prefix_of_the_order(tmp_path):
    full = load_sweep(_write(tmp_path, GRID))
    cut = load_sweep(_write(tmp_path, GRID.replace('name = "t"', 'name = "t"\nmax_configs = 4')))
    assert [it.spec_hash for it in cut.items] == [it.spec_hash for it in full.items[:4]]


def test_order_covers_every_axis_value_early_and_starts_cheap():
    # 3 axes x 3 values: the first 3 picks must already show every value of every axis
    keys = [(a, b, c) for a in range(3) for b in range(3) for c in range(3)]
    costs = [10.0 * a + b + c for a, b, c in keys]
    order = space_filling_order(keys, costs)
    assert sorted(order) == list(range(27))
    assert order[0] == keys.index((0, 0, 0))  # cheapest first
    first = [keys[i] for i in order[:3]]
    for axis in range(3):
        assert {k[axis] for k in first} == {0, 1, 2}


def test_impossible_combinations_are_dropped_and_counted(tmp_path):
    text = GRID.replace('seq_len = [64]', 'seq_len = [16, 64]')
    sweep = load_sweep(_write(tmp_path, text))
    assert len(sweep.items) == 12  # seq 16 cannot hold 25 image tokens
    assert sum(sweep.dropped.values()) == 12
    assert any("seq_len" in reason for reason in sweep.dropped)


def test_decoder_only_block_has_no_images_and_no_projector(tmp_path):
    text = """
[[block]]
decoder = ["llama-tiny"]
seq_len = [32]
train = ["full", "projector", "lora"]
lora_r = [2, 4]
"""
    sweep = load_sweep(_write(tmp_path, text))
    trains = Counter((it.spec.train, it.spec.lora.r if it.spec.lora else 0) for it in sweep.items)
    assert trains == {("full", 0): 1, ("lora", 2): 1, ("lora", 4): 1}
    assert all(it.spec.images_per_sample == 0 and it.image_tokens == 0 for it in sweep.items)


@pytest.mark.parametrize("text, match", [
    ('[[block]]\ndecoder = ["llama-tiny"]\nprecision = ["bf17"]', r"block\[0\]\.precision='bf17'.*valid: fp32"),
    ('[[block]]\ndecoder = ["llama-huge"]', r"block\[0\]\.decoder='llama-huge'.*valid:.*llama-7b"),
    ('[[block]]\ndecoder = ["llama-tiny"]\nprecsion = ["bf16"]', r"block\[0\]\.precsion=.*unknown key"),
    ('[sweep]\niterations = 1\n[[block]]\ndecoder = ["llama-tiny"]', r"sweep\.iterations=1"),
    ('[[block]]\ndecoder = ["llama-tiny"]\nsampling = "random"', r"block\[0\]\.samples=None"),
    ('[sweep]\nname = "x"', r"block=None.*at least one"),
    ('[[block]\ndecoder = 1', r"sweep=.*malformed TOML"),
])
def test_malformed_sweeps_name_the_field(tmp_path, text, match):
    with pytest.raises(SpecError, match=match):
        load_sweep(_write(tmp_path, text))


@pytest.mark.parametrize("name", sorted(p.name for p in SWEEPS.glob("*.toml")))
def test_shipped_sweeps_load(name):
    sweep = load_sweep(SWEEPS / name)
    assert sweep.items and sweep.iterations >= 3


def test_h200_first_contains_the_paper_setting():
    """LLaVA-1.5-7B stage 2, seq 2048 x micro-batch 8, checkpointing (arXiv 2512.07853, 8.7%)."""
    sweep = load_sweep(SWEEPS / "h200-first.toml")
    paper = [it for it in sweep.items
             if it.label == "clip-vit-l14-336@336+llama-7b" and it.spec.train == "llm+projector"
             and it.spec.seq_len == 2048 and it.spec.micro_batch == 8 and it.spec.grad_ckpt]
    assert paper
    # the 7B-shaped model is the real LLaVA-1.5-7B: same parameter shapes as the preset
    from hybridmem.models.loader import load_config_dict

    _, preset = load_config_dict("llava-1.5-7b")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert paper[0].config["text_config"][key] == preset["text_config"][key]
        assert paper[0].config["vision_config"][key] == preset["vision_config"][key]


def test_image_size_rebuilds_llava15_towers_but_not_llava_next_ones(tmp_path):
    text = """
[[block]]
model = ["llava-1.5-7b", "llava-v1.6-mistral-7b"]
image_size = [672]
seq_len = [4096]
"""
    items = {it.label: it for it in load_sweep(_write(tmp_path, text)).items}
    v15, nxt = items["llava-1.5-7b"], items["llava-v1.6-mistral-7b"]
    # LLaVA-1.5 takes its tower's native size only: the tower is built at 672 -> 48^2 tokens
    assert v15.config["vision_config"]["image_size"] == 672 and v15.image_tokens == 48 * 48
    # LLaVA-NeXT tiles a 672 px image onto its 336 px tower (anyres)
    assert nxt.config["vision_config"]["image_size"] == 336 and nxt.spec.image_size == 672


def test_memory_savers_sweep_covers_every_technique():
    """Issue 12: each saver on its own and the README's QLoRA stack, ready for a GPU."""
    sweep = load_sweep(SWEEPS / "memory-savers.toml")
    specs = [i.spec for i in sweep.items]
    assert {s.quantize for s in specs} >= {"none", "nf4", "int8"}
    assert any(s.liger for s in specs) and any(s.chunked_ce for s in specs)
    assert any(s.optimizer_in_backward for s in specs)
    assert {s.grad_ckpt_policy for s in specs} >= {"full", "every:2", "ops"}
    assert {s.offload_activations for s in specs} >= {"none", "all", "ckpt-inputs"}
    assert any(s.packing for s in specs)
    assert {s.optimizer for s in specs} >= {"paged-adamw-8bit", "adamw-8bit", "hf-adafactor"}
    stack = [s for s in specs if s.quantize == "nf4" and s.liger and s.grad_ckpt
             and s.optimizer == "paged-adamw-8bit" and s.images_per_sample]
    assert stack  # QLoRA + checkpointing + paged 8-bit AdamW + Liger on LLaVA shapes
