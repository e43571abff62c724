"""The model graph against the real `transformers` models instantiated on the meta device.

Expected numbers come from the models themselves (meta-device `named_parameters()`), from
docs/design.md's published counts, or from transformers' own LLaVA-NeXT packing code run on a tiny
real model — never from the code under test.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridmem import SpecError, TrainingSpec
from hybridmem.models import build_graph, load_config, preset_names
from hybridmem.job.spec import LoraSpec


def _meta_model(config):
    import transformers
    from hybridmem.models.loader import auto_class

    # the Auto class the tiers build the family with (image-text-to-text for the VLMs)
    with torch.device("meta"):
        return getattr(transformers, auto_class(config.model_type)).from_config(config)


def _spec(model: str, **kw) -> TrainingSpec:
    kw.setdefault("micro_batch", 1)
    kw.setdefault("seq_len", 4096)
    return TrainingSpec(model=model, **kw)


def _assert_matches_meta(model: str, **kw) -> None:
    graph = build_graph(_spec(model, **kw))
    meta = _meta_model(load_config(model))
    want = {n: p.numel() for n, p in meta.named_parameters()}
    assert graph.param_names() == want
    want_buffers = {n: b.numel() * b.element_size() for n, b in meta.named_buffers()}
    # itemsize None: the parameters' dtype (Gemma's 0-dim `embed_scale`, built under the
    # default dtype), here the meta model's
    param_size = next(meta.parameters()).element_size()
    got_buffers = {".".join(x for x in (m.prefix, layer.scope, b.name) if x):
                   b.numel * (b.itemsize or param_size)
                   for m in graph.modules for layer in m.layers for b in layer.buffers}
    assert got_buffers == want_buffers
    assert graph.num_params == sum(want.values())


def _analytic_presets() -> list[str]:
    """Presets of the families the analytic graph builds (every shipped preset today)."""
    from hybridmem.models.loader import is_analytic, model_type_of

    return [p for p in preset_names() if is_analytic(model_type_of(p))]


@pytest.mark.parametrize("preset", _analytic_presets())
def test_every_preset_matches_the_meta_device_model(preset):
    # pixtral-12b's default image (1024 px: 4096 tokens + 64 breaks) needs more than 4096
    _assert_matches_meta(preset, **({"seq_len": 8192} if preset == "pixtral-12b" else {}))


def test_llava_7b_published_counts():
    # docs/design.md, "Facts measured or read": parameter counts (meta-device instantiation)
    g = build_graph(_spec("llava-1.5-7b"))
    assert g.num_params == 7_063_427_072
    assert g.module("vision_tower").num_params == 303_507_456
    assert g.module("multi_modal_projector").num_params == 20_979_712
    assert g.module("language_model").num_params == 6_607_605_760
    assert g.module("lm_head").num_params == 131_334_144
    assert build_graph(_spec("llava-1.5-13b")).num_params == 13_351_494_656
    assert build_graph(_spec("llama-3.2-3b")).num_params == 3_212_749_824


def test_tied_embeddings_leave_lm_head_without_params():
    g = build_graph(_spec("llama-3.2-3b"))
    assert g.tied_embeddings
    assert g.module("lm_head").num_params == 0


def test_vision_feature_layer_minus_two_cuts_the_grad_path():
    # LLaVA reads hidden_states[-2]: the last CLIP layer and post_layernorm get no grads
    g = build_graph(_spec("llava-1.5-7b", train="full"))
    vt = {layer.name: layer for layer in g.module("vision_tower").layers}
    assert not vt["encoder.layers.23"].gets_grads
    assert not vt["post_layernorm"].gets_grads
    assert vt["encoder.layers.22"].gets_grads and vt["embeddings"].gets_grads


def test_llava_15_image_tokens_and_crops():
    g = build_graph(_spec("llava-1.5-7b", images_per_sample=2, micro_batch=3))
    assert g.image_tokens == 2 * 576      # 24 x 24 patches, CLS dropped (docs/design.md)
    assert g.vision_batch == 3 * 2        # one crop per image
    assert g.vision_seq == 577


# --- random small configs -----------------------------------------------------------------

def _text_config(draw, family: str) -> dict:
    heads = draw(st.sampled_from([2, 4]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    head_dim = draw(st.sampled_from([8, 16]))
    cfg = {"model_type": family, "hidden_size": draw(st.sampled_from([16, 32])),
           "intermediate_size": draw(st.sampled_from([24, 64])), "num_attention_heads": heads,
           "num_key_value_heads": kv, "num_hidden_layers": draw(st.integers(1, 3)),
           "vocab_size": draw(st.sampled_from([50, 96])), "max_position_embeddings": 256,
           "tie_word_embeddings": draw(st.booleans())}
    if family != "qwen2" and draw(st.booleans()):
        cfg["head_dim"] = head_dim  # explicit head_dim, may differ from hidden / heads
    if family in ("llama", "qwen3"):
        cfg["attention_bias"] = draw(st.booleans())
        cfg["mlp_bias"] = draw(st.booleans()) if family == "llama" else False
    return cfg


@st.composite
def small_configs(draw) -> dict:
    kind = draw(st.sampled_from(["llama", "mistral", "qwen2", "qwen3", "llava", "llava_next"]))
    if kind in ("llama", "mistral", "qwen2", "qwen3"):
        return _text_config(draw, kind)
    vision = draw(st.sampled_from(["clip_vision_model", "siglip_vision_model"]))
    patch = 4
    side = draw(st.sampled_from([2, 3]))
    layers = draw(st.integers(1, 3))
    vc = {"model_type": vision, "hidden_size": 16, "intermediate_size": 32,
          "num_attention_heads": 2, "num_hidden_layers": layers,
          "image_size": patch * side, "patch_size": patch}
    feature = draw(st.sampled_from([-1, -2, [-1, -2], 0])) if layers > 1 else -1
    strategy = "default" if vision.startswith("clip") else "full"
    cfg = {"model_type": kind, "vision_config": vc,
           "text_config": _text_config(draw, draw(st.sampled_from(["llama", "mistral", "qwen2"]))),
           "vision_feature_layer": feature, "vision_feature_select_strategy": strategy,
           "image_token_index": 3, "projector_hidden_act": "gelu",
           "multimodal_projector_bias": draw(st.booleans())}
    cfg["text_config"]["tie_word_embeddings"] = False
    cfg["tie_word_embeddings"] = draw(st.booleans())
    if kind == "llava_next":
        s = vc["image_size"]
        cfg["image_grid_pinpoints"] = [[s, 2 * s], [2 * s, s], [2 * s, 2 * s]]
    return cfg


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=small_configs())
def test_random_small_configs_match_the_meta_device_model(cfg, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    kw = {} if "vision_config" in cfg else {"images_per_sample": 0}
    _assert_matches_meta(str(path), seq_len=512, **kw)


# --- LLaVA-NeXT anyres token counting, against transformers' own packing ----------------------

@pytest.mark.parametrize("size", [30, 45, 60, 20, 100, 31])
def test_llava_next_tokens_follow_transformers_packing(size):
    from transformers import LlavaNextForConditionalGeneration
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    config = load_config("tiny-llava-next")  # 30 px crops, pinpoints 30x60 ... 30x90
    model = LlavaNextForConditionalGeneration(config).eval()
    crops = image_size_to_num_patches((size, size), config.image_grid_pinpoints, 30)
    pixels = torch.zeros(1, crops, 3, 30, 30)
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=pixels, image_sizes=[[size, size]])
    want_tokens = out.pooler_output[0].shape[0]
    g = build_graph(TrainingSpec(model="tiny-llava-next", image_size=size, seq_len=512))
    assert g.image_tokens == want_tokens
    assert g.vision_batch == crops


def test_llava_next_native_size_tokens():
    # 336 px on 336-multiple pinpoints: best fit 336x672 -> 2 tiles + base = 3 crops;
    # base 576 + unpadded 24 rows x (24 cols + 1 newline) = 600 -> 1176 tokens
    g = build_graph(_spec("llava-v1.6-mistral-7b"))
    assert (g.vision_batch, g.image_tokens) == (3, 1176)


# --- training flags and LoRA --------------------------------------------------------------

def test_train_modes_set_trainable_modules():
    def trainable(mode):
        g = build_graph(_spec("tiny-llava", train=mode))
        return {m.name for m in g.modules if any(layer.trainable for layer in m.layers)}

    assert trainable("full") == {"vision_tower", "multi_modal_projector", "language_model",
                                 "lm_head"}
    assert trainable("llm+projector") == {"multi_modal_projector", "language_model", "lm_head"}
    assert trainable("projector") == {"multi_modal_projector"}
    assert trainable("lora") == set()


def test_lora_adapters_match_peft_on_the_meta_device():
    import peft

    spec = _spec("tiny-llava", train="lora", lora=LoraSpec(r=4, targets=("q_proj", "down_proj")))
    g = build_graph(spec)
    model = _meta_model(load_config("tiny-llava"))
    cfg = peft.LoraConfig(r=4, target_modules=r"^(?!.*vision_tower).*\.(q_proj|down_proj)$")
    with torch.device("meta"):
        peft_model = peft.get_peft_model(model, cfg)
    want = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    got = sum(m.num_lora_params for m in g.modules)
    # by hand: 2 LM layers (hidden 64, ffn 128), r=4: q_proj A 4x64 + B 64x4,
    # down_proj A 4x128 + B 64x4 per layer
    assert got == want == 2 * (4 * 64 + 64 * 4) + 2 * (4 * 128 + 64 * 4)


# --- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("kw, field", [
    ({"model": "tiny-llava", "image_size": 64}, "image_size"),
    ({"model": "llama-3.2-3b", "images_per_sample": 1}, "images_per_sample"),
    ({"model": "tiny-llava", "seq_len": 20}, "seq_len"),
    ({"model": "llama-3.2-3b", "train": "projector"}, "train"),
    ({"model": "tiny-llava", "train": "lora", "lora": LoraSpec(targets=("nope",))},
     "lora.targets"),
])
def test_bad_model_dependent_input_names_the_field(kw, field):
    with pytest.raises(SpecError, match=rf"^{field}="):
        build_graph(TrainingSpec(**kw))


def test_image_size_error_lists_the_valid_size():
    with pytest.raises(SpecError, match=r"valid: 30\)"):
        build_graph(TrainingSpec(model="tiny-llava", image_size=64))


def test_lora_target_error_lists_existing_names():
    with pytest.raises(SpecError, match="q_proj") as err:
        build_graph(TrainingSpec(model="tiny-llava", train="lora", lora=LoraSpec(targets=("x",))))
    assert "down_proj" in str(err.value)


def test_siglip_tower_has_no_cls_and_its_head_gets_no_grads():
    # 32 px / 8 px patches: 16 tokens per crop (no CLS), `full` strategy keeps all 16
    g = build_graph(TrainingSpec(model="tiny-llava-siglip", seq_len=64, train="full"))
    assert (g.vision_seq, g.image_tokens) == (16, 16)
    vt = {layer.name: layer for layer in g.module("vision_tower").layers}
    assert not vt["head"].gets_grads and not vt["post_layernorm"].gets_grads
    assert vt["encoder.layers.2"].gets_grads  # feature layer -1: every encoder layer is used


def test_feature_layer_list_widens_the_projector(tmp_path):
    from hybridmem.models.loader import load_config_dict

    _, data = load_config_dict("tiny-llava")
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    data["vision_feature_layer"] = [-2, -3]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    g = build_graph(TrainingSpec(model=str(path), seq_len=64))
    proj = g.module("multi_modal_projector").layers[0]
    assert proj.dims["d_in"] == 2 * 32
    vt = {layer.name: layer for layer in g.module("vision_tower").layers}
    assert not vt["encoder.layers.2"].on_grad_path and vt["encoder.layers.1"].on_grad_path


# --- the light config reader (no transformers import on the analytic path) -----------------

def test_build_graph_imports_neither_torch_nor_transformers():
    """Every preset of a family with its own light config reader (all but those declaring
    `full_config`: transformers' class reads theirs) is estimated, in one fresh process,
    without importing torch or transformers (the ~4 s import the analytic tier exists to
    avoid)."""
    import subprocess
    import sys

    from hybridmem.families import family
    from hybridmem.models.loader import model_type_of

    from hybridmem.families import NO_SDPA

    fams = {n: family(model_type_of(n)) for n in preset_names()}
    runs = [(n, "eager" if f.has(NO_SDPA) else "sdpa") for n, f in fams.items()
            if f is not None and not f.full_config]
    assert {"llava-1.5-7b", "gemma-3-4b-it", "internvl3-2b-hf", "qwen3-vl-8b-instruct",
            "smolvlm-256m-instruct", "mistral-small-3.1-24b-instruct-2503", "gemma-2-9b"
            } <= {n for n, _ in runs}
    # bf16: the MoE closed forms are bf16 only; a long sequence fits any default image
    code = ("import sys; from hybridmem import TrainingSpec; from hybridmem.analytic import estimate\n"
            f"for n, a in {runs!r}:\n"
            "    estimate(TrainingSpec(model=n, seq_len=8192, precision='bf16', attn=a))\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("patch, field", [
    ({"text_config": {"hidden_size": "64"}}, "text_config.hidden_size"),
    ({"text_config": {"num_key_value_heads": 3}}, "text_config.num_key_value_heads"),
    ({"vision_config": {"model_type": "clip_vision_model", "num_attention_heads": 5}},
     "vision_config.hidden_size"),
    ({"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy"),
    ({"vision_config": {"model_type": "vit"}}, "vision_config.model_type"),
    ({"model_type": "gpt2"}, "model_type"),
])
def test_malformed_config_values_name_the_field(tmp_path, patch, field):
    from hybridmem.models.loader import load_config_dict

    _, data = load_config_dict("tiny-llava")
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError, match=rf"^{field}="):
        build_graph(TrainingSpec(model=str(path), seq_len=64))


# Published totals of the common fine-tuning targets: the model cards' / hub safetensors'
# parameter counts (the hub page's exact "Model size" total). The parametrized meta-device test
# above pins each graph to transformers' own model; this pins each transcribed config to the
# published model.
PUBLISHED_TOTALS = {
    "llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320, "llama-2-70b": 68_976_648_192,
    "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496,
    # Meta-Llama-3-8B / -70B: the model pages' 8.03B / 70.6B (Llama 3.1's shapes, the same count)
    "llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800, "llama-3.2-1b": 1_235_814_400,
    "mistral-7b-v0.3": 7_248_023_552, "mistral-nemo-base-2407": 12_247_782_400,
    "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512, "qwen2.5-14b": 14_770_033_664, "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-72b": 72_706_203_648,
    # Qwen3-1.7B: the hub's 2.03B counts lm_head.weight, stored in the safetensors although
    # tie_word_embeddings is true; the tied model has 151936 x 2048 fewer
    "qwen3-1.7b": 2_031_739_904 - 151_936 * 2_048,
    "qwen3-4b": 4_022_468_096, "qwen3-14b": 14_768_307_200, "qwen3-32b": 32_762_123_264,
    "gemma-2-27b": 27_227_128_320, "phi-3.5-mini-instruct": 3_821_079_552,
    "smollm2-135m": 134_515_008, "smollm2-360m": 361_821_120, "smollm2-1.7b": 1_711_376_384,
}


@pytest.mark.parametrize("preset,total", sorted(PUBLISHED_TOTALS.items()))
def test_fine_tuning_presets_match_the_published_size(preset, total):
    assert build_graph(_spec(preset)).num_params == total
