"""The launchers' own example configs answer as shipped (issue #34).

Each file under tests/data/launcher_examples/ has the shape of one example its launcher ships
(LLaMA-Factory examples/, axolotl examples/, torchtune recipes/configs/; the source file and
commit on its first line) with the example's own model id. Each is asked `--config FILE --gpu
a100-80gb` alone, plus `--world-size` where the answer asks for it, and the job it priced is
checked against the keys of the file (the expected values below are read off each file, with the
launcher's default cited where the file is silent). Then: flags override the file, one test per
job-schema group; the ZeRO-3 one-liner names how to give the GPU count.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hybridmem.answer import answer, resolve_job
from hybridmem.errors import SpecError
from hybridmem.gpus import gpu_by_name
from hybridmem.job import schema

DATA = Path(__file__).parent / "data" / "launcher_examples"
GPU = gpu_by_name("a100-80gb")

# (file, extra flags the answer asked for, expected job fields read off the file)
EXAMPLES = [
    # LLaMA-Factory: Qwen/Qwen3-4B-Instruct-2507 is Qwen3-4B's shapes (dated instruct release)
    ("llamafactory/qwen3_lora_sft.yaml", {},
     dict(model="qwen3-4b", train="lora", lora_r=8, seq_len=2048, grad_accum=8, micro_batch=1,
          precision="bf16-autocast")),
    ("llamafactory/qwen3_lora_sft_otfq.yaml", {},
     dict(model="qwen3-4b", train="lora", quantize="nf4", seq_len=2048)),
    ("llamafactory/qwen3_full_sft.yaml", {"world_size": 8},
     dict(model="qwen3-4b", train="full", strategy="zero3", world_size=8,
          precision="bf16-master")),
    ("llamafactory/qwen3_lora_dpo.yaml", {},
     dict(model="qwen3-4b", train="lora", objective="dpo", beta=0.1)),
    # image_max_pixels 262144: a 512x512 image, 16 x 16 merged patches of 32 px = 256 tokens
    ("llamafactory/qwen3vl_lora_sft.yaml", {},
     dict(model="qwen3-vl-4b-instruct", train="lora", image_size=512)),
    # axolotl: NousResearch/ and Meta-Llama-3 ids; sample_packing reaches packing
    ("axolotl/lora-1b.yml", {},
     dict(model="llama-3.2-1b", train="lora", lora_r=16, packing=True, micro_batch=2,
          attn="flash_attention_2", optimizer="adamw-8bit")),
    ("axolotl/qlora-1b.yml", {},
     dict(model="llama-3.2-1b", train="lora", quantize="nf4", lora_r=32, packing=True)),
    ("axolotl/fft-8b-zero3.yaml", {"world_size": 8},
     dict(model="llama-3-8b", train="full", strategy="zero3", seq_len=8192, packing=True,
          optimizer="paged-adamw-8bit")),
    ("axolotl/instruct-dpo-lora-8b.yml", {},
     dict(model="llama-3-8b", train="lora", objective="dpo", quantize="int8", seq_len=4096,
          packing=False)),
    ("axolotl/lora-7b-vl.yaml", {},
     dict(model="qwen2.5-vl-7b-instruct", train="lora", seq_len=8192,
          lora_target_regex=r"model.language_model.layers.[\d]+.(mlp|cross_attn|self_attn)."
                            r"(up|down|gate|q|k|v|o)_proj")),
    # torchtune: builders name their checkpoints; DPOLoss is the DPO recipe
    ("torchtune/1B_lora_single_device.yaml", {},
     dict(model="llama-3.2-1b", train="lora", lora_r=64, micro_batch=4, chunked_ce=8)),
    ("torchtune/8B_qlora_single_device.yaml", {},
     dict(model="llama-3.1-8b", train="lora", quantize="nf4", micro_batch=2)),
    # full_finetune_distributed on one GPU is FSDP over one rank: nothing sharded
    ("torchtune/8B_full.yaml", {},
     dict(model="llama-3.1-8b", train="full", strategy="none", world_size=1, grad_ckpt=True)),
    ("torchtune/8B_lora_dpo_single_device.yaml", {},
     dict(model="llama-3.1-8b", train="lora", objective="dpo", beta=0.1, micro_batch=4)),
    ("torchtune/7B_full_single_device_vl.yaml", {},
     dict(model="qwen2.5-vl-7b-instruct", train="full", optimizer="paged-adamw",
          optimizer_in_backward=True)),
]


def _ask(path: str, **flags):
    resolved, warnings = resolve_job({"config": str(DATA / path), **flags})
    return resolved, answer(resolved, warnings, GPU)


def _value(spec, key: str):
    meta = schema.BY_KEY[key]
    owner = {"spec": spec, "lora": spec.lora, "parallel": spec.parallel}[meta.owner]
    return getattr(owner, meta.name)


@pytest.mark.parametrize("path, flags, expected", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_example_answers_as_shipped(path, flags, expected):
    resolved, found = _ask(path, **flags)
    got = {k: _value(resolved.spec, k) for k in expected}
    if "image_size" in got:  # a square size echoes as its side
        got["image_size"] = int(str(got["image_size"]).split("x")[0])
    assert got == expected
    assert found.result.peak.device_bytes > 0
    assert found.result.job["model"] == expected["model"]
    # the hub id the file names is in the model's source
    assert "/" in resolved.sources["model"] or "model._component_" in resolved.sources["model"]


def test_torchtune_distributed_recipe_shards_with_fsdp2():
    """torchtune has no DDP recipe: on more GPUs its _distributed recipes shard with FSDP2."""
    resolved, _ = _ask("torchtune/8B_full.yaml", world_size=4)
    assert (resolved.spec.parallel.strategy, resolved.spec.parallel.world_size) == ("fsdp", 4)


@pytest.mark.parametrize("path", [e[0] for e in EXAMPLES if e[1]])
def test_zero3_examples_ask_for_the_gpu_count(path):
    """Launcher configs never say how many GPUs; the one line names --world-size and the
    launch commands that set it."""
    with pytest.raises(SpecError) as err:
        _ask(path)
    text = str(err.value)
    assert text.startswith("parallel.world_size=1:") and "\n" not in text
    for words in ("--world-size N", "--gpu-count N", "torchrun --nproc_per_node N",
                  "accelerate launch --num_processes N", "deepspeed --num_gpus N"):
        assert words in text


def test_vlm_image_tokens_follow_image_max_pixels():
    """Qwen3-VL at LLaMA-Factory's image_max_pixels 262144: a 512 x 512 image is 32 x 32
    patches of 16 px, merged 2 x 2: 256 tokens (not the 196 of the tower's default size)."""
    _, found = _ask("llamafactory/qwen3vl_lora_sft.yaml")
    notes = " ".join(found.result.notes)
    assert "256 of the 2048 tokens per sample are image tokens" in notes
    assert any("video_max_pixels" in w and "not priced" in w
               for w in found.result.job["warnings"])


def test_gemma3_vision_example_is_refused_as_transformers_would():
    """axolotl's gemma-3-4b-vision-qlora.yml asks flash_attention_2, which the installed
    transformers' Gemma3ForConditionalGeneration refuses (`_supports_flash_attn = False`), and
    its regex names `language_model.model.layers...`, which peft's full match finds nowhere in
    transformers 5's module tree (`model.language_model.layers...`)."""
    path = "axolotl/gemma-3-4b-vision-qlora.yml"
    with pytest.raises(SpecError, match=r"^attn='flash_attention_2': transformers' gemma3 code "
                                        r"does not support it \(Gemma3ForConditionalGeneration"):
        _ask(path)
    with pytest.raises(SpecError, match=r"^lora.target_regex='language_model\.model.*matches "
                                        r"none"):
        _ask(path, attn="sdpa")
    resolved, _ = _ask(path, attn="sdpa", lora_targets=r"model\.language_model\.layers\."
                                                            r"\d+\.(mlp|self_attn)\.\w+_proj")
    assert resolved.spec.lora.target_regex.startswith("model")


def test_cli_answers_with_config_and_gpu_alone():
    proc = subprocess.run([sys.executable, "-m", "hybridmem.cli", "predict", "--config",
                           str(DATA / "axolotl/lora-1b.yml"), "--gpu", "a100-80gb"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("model: llama-3.2-1b") and "NousResearch/Llama-3.2-1B" in first
    assert "packing=on (lora-1b.yml: sample_packing)" in proc.stdout


# --- flags override --config, one test per job-schema group --------------------------------

PRECEDENCE = {
    # group: (file, flags, fields the flags set, a field the file still sets)
    "model": ("axolotl/lora-1b.yml", {"model": "qwen3-4b", "attn": "eager"},
              {"model": "qwen3-4b", "attn": "eager"}, {"lora_r": 16}),
    "batch": ("llamafactory/qwen3_lora_sft.yaml", {"micro_batch": 3, "seq_len": 1024,
                                                    "grad_accum": 2},
              {"micro_batch": 3, "seq_len": 1024, "grad_accum": 2}, {"lora_r": 8}),
    "adapters": ("torchtune/1B_lora_single_device.yaml",
                 {"lora_r": 4, "lora_targets": "q_proj,v_proj"},
                 {"lora_r": 4, "lora_targets": ("q_proj", "v_proj")}, {"micro_batch": 4}),
    # names over a file's regex: the regex no longer applies
    "adapters-regex": ("axolotl/lora-7b-vl.yaml", {"lora_targets": "q_proj,v_proj"},
                       {"lora_targets": ("q_proj", "v_proj"), "lora_target_regex": None},
                       {"lora_r": 32}),
    "precision": ("axolotl/lora-1b.yml", {"optimizer": "adamw", "precision": "bf16"},
                  {"optimizer": "adamw", "precision": "bf16"}, {"micro_batch": 2}),
    "savers": ("axolotl/lora-1b.yml", {"grad_ckpt": False, "packing": False},
               {"grad_ckpt": False, "packing": False}, {"seq_len": 2048}),
    "loop": ("llamafactory/qwen3_lora_sft.yaml", {"max_grad_norm": 0.5},
             {"max_grad_norm": 0.5}, {"grad_accum": 8}),
    "objective": ("llamafactory/qwen3_lora_dpo.yaml", {"beta": 0.5},
                  {"beta": 0.5, "objective": "dpo"}, {"lora_r": 8}),
    "parallel": ("llamafactory/qwen3_full_sft.yaml", {"world_size": 2, "strategy": "zero2"},
                 {"world_size": 2, "strategy": "zero2"}, {"train": "full"}),
}


def test_every_group_has_a_precedence_case():
    assert {g.split("-")[0] for g in PRECEDENCE} == set(schema.by_group())


@pytest.mark.parametrize("group", sorted(PRECEDENCE))
def test_flags_override_the_config(group):
    path, flags, wanted, kept = PRECEDENCE[group]
    resolved, _ = resolve_job({"config": str(DATA / path), **flags})
    for key, value in wanted.items():
        assert _value(resolved.spec, key) == value, key
        if key in flags and key in resolved.sources:  # sources list non-default fields
            assert resolved.sources[key].startswith("flag --"), (key, resolved.sources[key])
    for key, value in kept.items():  # the rest of the file still counts
        assert _value(resolved.spec, key) == value, key


def test_model_flag_replaces_a_model_the_file_cannot_name():
    """`--model` is read in place of the file's model, so a file whose model is unknown here
    (a builder without a preset) still answers, and the launcher's model rules follow the flag's
    model (no image size for a text model)."""
    raw = (DATA / "torchtune/1B_lora_single_device.yaml").read_text().replace(
        "torchtune.models.llama3_2.lora_llama3_2_1b", "torchtune.models.llama3_2.lora_llama9_1b")
    with pytest.raises(SpecError, match="no preset for this builder"):
        resolve_job({"config": _write(raw)})
    resolved, _ = resolve_job({"config": _write(raw), "model": "llama-3.2-3b"})
    assert resolved.spec.model == "llama-3.2-3b" and resolved.spec.lora.r == 64
    resolved, _ = resolve_job({"config": str(DATA / "llamafactory/qwen3vl_lora_sft.yaml"),
                               "model": "qwen3-4b"})
    assert resolved.spec.model == "qwen3-4b" and resolved.spec.image_size is None


def _write(text: str) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        fh.write(text)
    return fh.name
