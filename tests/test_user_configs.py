"""Families without closed forms, as a user meets them: a tiny hand-written config.json (a few
keys, transformers' defaults for the rest) passed as `--model path` (docs/trace.md, "Which
models"). tests/test_generic.py writes its configs with `AutoConfig.for_model(...).to_dict()`
(every key); these are what a user types, so they also meet the family defaults that do not
fit a tiny model (Mllama's text `pad_token_id` 128004).

Per family: `hybridmem predict` without `--method` picks the trace tier and says why; the
parts table equals the meta-device model's parameters mapped by prefixes written out here
(read off the transformers module trees, not derived from `models.build.part_of`); the
analytic tier refuses in one line; the meta trace equals a real (non-fake) CPU run's live
bytes. Hand-made configs (no published source).
"""

from __future__ import annotations

import json

import pytest

from hybridmem.cli import main
from hybridmem.errors import SpecError
from hybridmem.models import load_config
from hybridmem.predict import predict
from hybridmem.job.spec import TrainingSpec
from hybridmem.trace import runner
from test_generic import meta_model
from test_trace import real_cpu_peak

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary
CONFIGS: dict[str, dict] = {
    "paligemma": dict(projection_dim=64, image_token_index=250, text_config=dict(
        TEXT, model_type="gemma", head_dim=16), vision_config=dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, image_size=28, patch_size=14,
        projection_dim=64)),
    # cross-attention layers 1 and 3 (MllamaCrossAttentionDecoderLayer); the vision model's
    # local + global encoders, gated tile / position embeddings
    "mllama": dict(image_token_index=250, text_config=dict(
        TEXT, **IDS, model_type="mllama_text_model", num_hidden_layers=4,
        cross_attention_layers=[1, 3]), vision_config=dict(
        model_type="mllama_vision_model", hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_global_layers=1, attention_heads=4, image_size=28,
        patch_size=14, max_num_tiles=2, vision_output_dim=64, intermediate_layers_indices=[0],
        supported_aspect_ratios=[[1, 1], [1, 2]])),
    "granite": dict(TEXT, **IDS, embedding_multiplier=12.0, logits_scaling=8.0,
                    residual_multiplier=0.22, attention_multiplier=0.015625),
    "cohere": dict(TEXT, **IDS, use_qk_norm=True),  # parallel attention + MLP, tied
}
# parameter-name prefix -> part, per VLM (modeling_paligemma.PaliGemmaModel,
# modeling_mllama.MllamaModel); the rest is the language model, `lm_head` the head
PARTS: dict[str, dict[str, str]] = {
    "paligemma": {"model.vision_tower.": "vision_tower",
                  "model.multi_modal_projector.": "multi_modal_projector"},
    "mllama": {"model.vision_model.": "vision_tower",
               "model.multi_modal_projector.": "multi_modal_projector"},
}


def write(tmp_path, family: str, **patch) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": family, **CONFIGS[family], **patch}))
    return str(path)


def parts_of(model, family: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        part = next((v for k, v in PARTS.get(family, {}).items() if name.startswith(k)),
                    "lm_head" if name.startswith("lm_head") else "language_model")
        out[part] = out.get(part, 0) + p.numel()
    return out


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_hand_written_config_is_priced_by_the_trace_tier(family, tmp_path, capsys):
    path = write(tmp_path, family)
    assert main(["predict", "--model", path, "--micro-batch", "1", "--seq-len", "16",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "trace"
    assert (f"method: trace chosen because the analytic tier refuses model_type='{family}': "
            "this family has no closed forms here (pass --method to override)") in out["notes"]
    ref = parts_of(meta_model(path), family)
    assert {m["name"]: m["params"] for m in out["modules"] if m["params"]} == ref
    with pytest.raises(SpecError, match=rf"^model_type='{family}': this family has no closed "
                                        r"forms here; use --method trace$"):
        predict(TrainingSpec(model=path, seq_len=16), method="analytic")
    spec = TrainingSpec(model=path, micro_batch=1, seq_len=16, precision="fp32")
    tracker, _ = runner.trace(spec, load_config(path), backend="meta")
    assert int(tracker.live_curve(device_only=False).max()) == real_cpu_peak(spec)


def test_the_api_chooses_the_tier_as_the_cli_does(tmp_path, capsys):
    """`predict(spec)` without a method on a family only the trace tier prices: the trace tier,
    the CLI's note and its reason in the JSON, the same numbers as `hybridmem predict`."""
    path = write(tmp_path, "granite")
    pred = predict(TrainingSpec(model=path, micro_batch=1, seq_len=16))
    assert main(["predict", "--model", path, "--micro-batch", "1", "--seq-len", "16",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert pred.method == out["method"] == "trace"
    note = ("method: trace chosen because the analytic tier refuses model_type='granite': this "
            "family has no closed forms here (pass --method to override)")
    assert note in pred.notes and note in out["notes"]
    assert pred.to_dict()["method_reason"] == out["method_reason"] == (
        "the analytic tier refuses model_type='granite': this family has no closed forms here")
    assert pred.to_dict()["peak"] == out["peak"]


def test_a_family_default_pad_id_outside_a_tiny_vocabulary_is_one_line(tmp_path):
    """MllamaTextConfig's default pad_token_id (128004) with a 256-token vocabulary: no backend
    can build the embedding (`padding_idx`), so the field is named, not the fake tensors."""
    config = CONFIGS["mllama"]
    text = {k: v for k, v in config["text_config"].items() if k != "pad_token_id"}
    path = write(tmp_path, "mllama", text_config=text)
    with pytest.raises(SpecError, match=r"^text_config.pad_token_id=128004: must be below "
                                        r"vocab_size=256"):
        predict(TrainingSpec(model=path, seq_len=16), method="trace")
