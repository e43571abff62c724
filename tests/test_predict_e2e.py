"""End to end through the real analytic tier: every preset, the JSON contract, the max batch.

These check the whole against its parts (module params sum to the meta-device total, the
breakdown sums to the device peak) and the search against its definition (B fits, B+1 not).
"""

from __future__ import annotations

import json

import pytest

from hybridmem import TrainingSpec, predict
from hybridmem.cli import main
from hybridmem.gpus import gpu_by_name
from hybridmem.models import preset_names

# Meta-device parameter counts (torch.device("meta") instantiation of the transformers model
# from each preset config; also docs/design.md for llava-1.5-7b/13b and llama-3.2-3b).
META_PARAMS = {
    "llava-1.5-7b": 7_063_427_072,
    "llava-1.5-13b": 13_351_494_656,
    "llava-v1.6-mistral-7b": 7_566_747_648,
    "llama-3.2-3b": 3_212_749_824,
    "qwen2-7b": 7_615_616_512,
    "tiny-llava": 126_784,
}


@pytest.mark.parametrize("name", sorted(META_PARAMS))
def test_every_preset_predicts_consistently(name):
    # LLaVA-NeXT's anyres tiles take 1176 tokens for one 336 px image, so give it 2048
    p = predict(TrainingSpec(model=name, micro_batch=2, seq_len=2048, grad_ckpt=True))
    assert p.params_total == META_PARAMS[name]
    assert sum(m.params for m in p.modules) == p.params_total
    assert sum(p.breakdown.values()) == p.peak.device_bytes
    assert 0 < p.peak.allocated_bytes <= p.peak.reserved_bytes <= p.peak.device_bytes
    # full fine-tune: every parameter trains except CLIP layers past vision_feature_layer=-2
    assert p.params_trainable <= p.params_total


def test_all_presets_are_covered():
    assert set(META_PARAMS) <= set(preset_names())


def test_peak_grows_with_batch_and_sequence():
    base = TrainingSpec(model="llava-1.5-7b", micro_batch=1, seq_len=1024,
                        train="llm+projector", precision="bf16-mixed")
    peaks = [predict(base.with_(micro_batch=b)).peak.device_bytes for b in (1, 2, 4)]
    assert peaks[0] < peaks[1] < peaks[2]
    assert predict(base.with_(seq_len=2048)).peak.device_bytes > peaks[0]
    # checkpointing trades activations for recompute: never more memory; strictly less where
    # activations set the peak (stage 1: only the projector trains, so no big optimizer step)
    ck = predict(base.with_(micro_batch=4, grad_ckpt=True)).peak.device_bytes
    assert ck <= peaks[2]
    stage1 = base.with_(train="projector", micro_batch=16)
    assert (predict(stage1.with_(grad_ckpt=True)).peak.device_bytes
            < predict(stage1).peak.device_bytes)


def test_frozen_vision_tower_has_no_grads_or_state():
    p = predict(TrainingSpec(model="llava-1.5-7b", train="llm+projector", seq_len=1024))
    vision = next(m for m in p.modules if m.name == "vision_tower")
    assert vision.trainable_params == 0 and vision.grad == 0 and vision.optimizer == 0
    stage1 = predict(TrainingSpec(model="llava-1.5-7b", train="projector", seq_len=1024))
    # only the projector trains in LLaVA stage 1 (docs/design.md): 20,979,712 params (meta device)
    assert stage1.params_trainable == 20_979_712


def test_find_max_batch_is_the_largest_that_fits():
    gpu = gpu_by_name("h100-80gb")
    spec = TrainingSpec(model="llava-1.5-7b", seq_len=2048, train="lora", grad_ckpt=True,
                        precision="bf16")
    p = predict(spec, gpu=gpu, find_max_batch=True)
    b = p.max_micro_batch
    assert b >= 1
    assert predict(spec.with_(micro_batch=b)).peak.device_bytes <= gpu.memory_bytes
    assert predict(spec.with_(micro_batch=b + 1)).peak.device_bytes > gpu.memory_bytes


def test_issue_command_json(capsys):
    """The issue's acceptance command, as JSON: it does not fit one H100 (bf16-master keeps
    2 + 12 bytes per trainable param: 6.76e9 * 14 B = 88 GiB > 79.6 GiB before activations)."""
    rc = main(["predict", "--model", "llava-1.5-7b", "--micro-batch", "8", "--seq-len", "2048",
               "--train", "llm+projector", "--grad-ckpt", "--precision", "bf16-master",
               "--gpu", "h100-80gb", "--find-max-batch", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["max_micro_batch"] == 0
    # trainable = 7,063,427,072 total - 303,507,456 vision (meta-device counts, docs/design.md)
    assert out["params"]["trainable"] == 6_759_919_616
    assert out["peak"]["device_bytes"] > 6_759_919_616 * 14
    assert [m["name"] for m in out["modules"]][:2] == ["vision_tower", "multi_modal_projector"]


@pytest.mark.parametrize("argv,match", [
    (["--model", "llava-1.5-7b", "--image-size", "224"], "error: image_size=224"),
    (["--model", "llama-3.2-3b", "--images-per-sample", "1"], "error: images_per_sample=1"),
    (["--model", "llava-1.5-7b", "--seq-len", "100"], "error: seq_len=100"),
    (["--model", "llava-1.5-7b", "--train", "lora", "--lora-targets", "qkv"], "error: lora.targets="),
])
def test_model_dependent_bad_input(argv, match, capsys):
    assert main(["predict", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(match), err
    assert err.count("\n") == 1
