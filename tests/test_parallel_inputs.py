"""DeepSpeed JSON, HF TrainingArguments and recipe presets -> TrainingSpec; bad input one-liners."""

from __future__ import annotations

import json

import pytest

from hybridmem.errors import SpecError
from hybridmem.intake.merge import merge_inputs, spec_from_inputs
from hybridmem.intake.readers.deepspeed import from_deepspeed_json
from hybridmem.intake.readers.trainer import from_training_args
from hybridmem.intake.recipes import RECIPES, ZERO3_JSON
from hybridmem.job.parallel import ParallelSpec
from hybridmem.job.spec import TrainingSpec

H7B = 4096  # llava-1.5-7b text_config.hidden_size (Vicuna-7B / Llama-2-7B)


def _write(tmp_path, name, data) -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_auto_resolved_like_transformers():
    # HfTrainerDeepSpeedConfig.trainer_config_finalize: reduce_bucket_size = h*h,
    # stage3_prefetch_bucket_size = int(0.9*h*h), stage3_param_persistence_threshold = 10*h
    out = from_deepspeed_json(ZERO3_JSON, hidden_size=H7B,
                              hf={"per_device_train_batch_size": 4, "bf16": True, "fp16": False,
                                  "gradient_accumulation_steps": 1})
    p = out["parallel"]
    assert p["reduce_bucket_size"] == 16_777_216
    assert p["stage3_prefetch_bucket_size"] == 15_099_494
    assert p["stage3_param_persistence_threshold"] == 40_960
    assert p["stage3_max_live_parameters"] == 10**9  # 1e9 in the JSON becomes an integer
    assert out["spec"] == {"precision": "bf16-master", "micro_batch": 4}  # bf16 "auto" <- args


def test_hidden_size_of_llava_comes_from_text_config():
    kwargs = merge_inputs(deepspeed=ZERO3_JSON, overrides={"model": "llava-1.5-7b", "world_size": 8})
    assert kwargs["parallel"].reduce_bucket_size == H7B * H7B


def test_recipe_finetune():
    spec = spec_from_inputs(recipe="llava-1.5-finetune", overrides={"model": "llava-1.5-7b"})
    assert (spec.train, spec.micro_batch, spec.seq_len, spec.grad_ckpt, spec.attn) == (
        "llm+projector", 16, 2048, True, "flash_attention_2")
    assert spec.precision == "bf16-master" and spec.optimizer == "adamw"
    assert (spec.parallel.strategy, spec.parallel.world_size) == ("zero3", 8)


def test_recipe_pretrain_and_lora():
    pre = spec_from_inputs(recipe="llava-1.5-pretrain", overrides={"model": "llava-1.5-7b"})
    assert (pre.train, pre.micro_batch, pre.parallel.strategy) == ("projector", 32, "zero2")
    assert pre.parallel.overlap_comm is True
    lora = spec_from_inputs(recipe="llava-1.5-finetune-lora", overrides={"model": "llava-1.5-7b"})
    assert (lora.train, lora.lora.r, lora.lora.alpha, lora.parallel.strategy) == ("lora", 128, 256, "zero3")
    assert set(RECIPES) == {"llava-1.5-pretrain", "llava-1.5-finetune", "llava-1.5-finetune-lora"}


def test_overrides_win_over_files(tmp_path):
    args = _write(tmp_path, "args.json", {"per_device_train_batch_size": 4, "bf16": True,
                                          "gradient_checkpointing": False, "world_size": 4})
    spec = spec_from_inputs(recipe="llava-1.5-finetune", training_args=args,
                            overrides={"model": "llava-1.5-7b", "micro_batch": 2,
                                       "world_size": 16, "zero_stage": 2, "grad_ckpt": True,
                                       "seq_len": None})
    assert (spec.micro_batch, spec.parallel.world_size, spec.parallel.strategy) == (2, 16, "zero2")
    assert spec.grad_ckpt is True and spec.seq_len == 2048  # None = not given


def test_training_args_alone_is_ddp_with_autocast(tmp_path):
    args = _write(tmp_path, "a.json", {"per_device_train_batch_size": 2, "bf16": True,
                                       "optim": "adamw_bnb_8bit", "world_size": 2})
    spec = spec_from_inputs(training_args=args, overrides={"model": "llama-3.2-3b"})
    assert (spec.precision, spec.optimizer, spec.parallel.strategy) == ("bf16-mixed", "adamw-8bit", "ddp")


def test_training_args_fsdp(tmp_path):
    args = _write(tmp_path, "a.json", {"fsdp": "shard_grad_op auto_wrap", "bf16": True,
                                       "world_size": 8})
    spec = spec_from_inputs(training_args=args, overrides={"model": "llama-3.2-3b"})
    assert spec.parallel.strategy == "fsdp" and spec.parallel.reshard_after_forward is False


def test_training_args_deepspeed_path(tmp_path):
    ds = _write(tmp_path, "ds.json", {"zero_optimization": {"stage": 1}, "bf16": {"enabled": "auto"},
                                      "optimizer": {"type": "AdamW"}})
    args = _write(tmp_path, "a.json", {"deepspeed": ds, "bf16": True, "world_size": 4})
    spec = spec_from_inputs(training_args=args, overrides={"model": "llama-3.2-3b"})
    # DeepSpeed's own AdamW is FusedAdam
    assert (spec.parallel.strategy, spec.precision, spec.optimizer) == ("zero1", "bf16-master", "adamw-fused")


def test_world_size_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert from_training_args({"bf16": True})["parallel"]["world_size"] == 4


def test_train_batch_size_fixes_world_size():
    # DeepSpeed: train_batch_size = micro * grad_accum * world -> 64 / (4 * 2) = 8
    out = from_deepspeed_json({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
                               "gradient_accumulation_steps": 2,
                               "zero_optimization": {"stage": 2}})
    assert out["parallel"]["world_size"] == 8


def test_nvme_offload_priced_as_cpu():
    out = from_deepspeed_json({"zero_optimization": {"stage": 3,
                                                     "offload_optimizer": {"device": "nvme"}}})
    assert out["parallel"]["offload_optimizer"] == "cpu"


def test_round_trip_through_to_dict():
    spec = spec_from_inputs(recipe="llava-1.5-finetune", overrides={"model": "llava-1.5-7b"})
    assert TrainingSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


# ---------------------------------------------------------------- bad input: one line, named field

def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_malformed_json(tmp_path):
    bad = _write(tmp_path, "ds.json", '{"zero_optimization": {"stage": 3,}}')
    with pytest.raises(SpecError, match=r"deepspeed=.*malformed JSON.*line 1") as err:
        merge_inputs(deepspeed=bad, overrides={"model": "llava-1.5-7b"})
    _one_line(err)


def test_missing_file():
    with pytest.raises(SpecError, match="training_args=.*file not found"):
        merge_inputs(training_args="/nonexistent/args.json")


def test_auto_needs_model():
    with pytest.raises(SpecError, match=r"reduce_bucket_size='auto'.*--model") as err:
        merge_inputs(deepspeed=ZERO3_JSON)
    _one_line(err)


def test_auto_that_transformers_does_not_resolve():
    """transformers fills no "auto" for these keys, and DeepSpeed drops a leftover "auto" to
    keep its field default (runtime/config_utils.py `DeepSpeedConfigModel.__init__`): axolotl's
    deepspeed_configs/zero3_bf16.json writes the short `prefetch_bucket_size: auto`."""
    from hybridmem.job.parallel import ParallelSpec

    layer = from_deepspeed_json({"zero_optimization": {
        "stage": 3, "allgather_bucket_size": "auto", "prefetch_bucket_size": "auto",
        "param_persistence_threshold": "auto"}}, hidden_size=H7B)
    defaults = ParallelSpec()
    for name in ("allgather_bucket_size", "stage3_prefetch_bucket_size",
                 "stage3_param_persistence_threshold"):
        assert name not in layer["parallel"]  # DeepSpeed's default: 5e8, 5e7, 1e5
        assert "DeepSpeed's default" in layer["sources"][name]
    assert defaults.stage3_prefetch_bucket_size == 50_000_000  # zero/config.py default


def test_bad_stage():
    with pytest.raises(SpecError, match=r"stage=4.*valid: 0, 1, 2, 3"):
        from_deepspeed_json({"zero_optimization": {"stage": 4}})


def test_fsdp_and_deepspeed_together(tmp_path):
    args = {"fsdp": "full_shard", "deepspeed": {"zero_optimization": {"stage": 2}}}
    with pytest.raises(SpecError, match="FSDP and DeepSpeed cannot both be set"):
        from_training_args(args)
    with pytest.raises(SpecError, match="FSDP .* and DeepSpeed cannot both be set"):
        merge_inputs(training_args={"fsdp": "full_shard", "world_size": 2},
                     deepspeed={"zero_optimization": {"stage": 2}},
                     overrides={"model": "llama-3.2-3b"})


def test_zero_with_one_gpu_changes_nothing():
    with pytest.raises(SpecError, match=r"parallel.world_size=1: zero2 over one GPU shards nothing"):
        ParallelSpec(world_size=1, strategy="zero2")
    with pytest.raises(SpecError, match="fsdp over one GPU"):
        ParallelSpec(world_size=1, strategy="fsdp")
    # ZeRO-Offload on one GPU does change memory: allowed
    assert ParallelSpec(world_size=1, strategy="zero2", offload_optimizer="cpu").zero_stage == 2


def test_offload_needs_cpu_adam():
    with pytest.raises(SpecError, match=r"optimizer='sgd': optimizer offload .*DeepSpeedCPUAdam.*valid: adamw, adamw-fused"):
        spec_from_inputs(deepspeed={"zero_optimization": {"stage": 2,
                                                          "offload_optimizer": {"device": "cpu"}}},
                         overrides={"model": "llama-3.2-3b", "optimizer": "sgd", "world_size": 2})


def test_offload_without_zero_and_param_offload_without_stage3():
    with pytest.raises(SpecError, match="CPU offload is a DeepSpeed ZeRO feature"):
        ParallelSpec(world_size=2, strategy="fsdp", offload_optimizer="cpu")
    with pytest.raises(SpecError, match="parameter offload needs zero3, not zero2"):
        ParallelSpec(world_size=2, strategy="zero2", offload_param="cpu")


def test_unknown_names():
    with pytest.raises(SpecError, match=r"recipe='llava-2'.*valid: llava-1.5-finetune"):
        merge_inputs(recipe="llava-2")
    with pytest.raises(SpecError, match=r"training_args.optim='adamw_torch_4bit'"):
        from_training_args({"optim": "adamw_torch_4bit"})
    with pytest.raises(SpecError, match=r"deepspeed.optimizer.type='lamb'"):
        from_deepspeed_json({"optimizer": {"type": "Lamb"}})
    with pytest.raises(SpecError, match=r"overrides='gpus'"):
        merge_inputs(overrides={"gpus": 8})


def test_fsdp_offload_not_modelled():
    with pytest.raises(SpecError, match="FSDP CPU offload is not modelled"):
        from_training_args({"fsdp": "full_shard offload"})


def test_inconsistent_batch_sizes():
    with pytest.raises(SpecError, match="train_batch_size=30: is not micro batch 4"):
        from_deepspeed_json({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})
    with pytest.raises(SpecError, match="train_micro_batch_size_per_gpu=4: TrainingArguments say 2"):
        merge_inputs(training_args={"per_device_train_batch_size": 2},
                     deepspeed={"train_micro_batch_size_per_gpu": 4})


def test_world_size_without_strategy_is_ddp_but_spec_refuses_none():
    assert merge_inputs(overrides={"model": "llama-3.2-3b", "world_size": 4})["parallel"].strategy == "ddp"
    with pytest.raises(SpecError, match="world_size=4 needs a data-parallel strategy"):
        ParallelSpec(world_size=4, strategy="none")


def test_sft_config_max_length_is_the_sequence_length():
    # TRL SFTConfig's `max_length` (older `max_seq_length`) truncates every sample, so the
    # longest batch has that many tokens; `max_length: null` truncates nothing (not read)
    base = {"per_device_train_batch_size": 2, "bf16": True}
    for key in ("max_length", "max_seq_length"):
        spec = spec_from_inputs(training_args={**base, key: 1536}, overrides={"model": "tiny-llama"})
        assert spec.seq_len == 1536
    assert spec_from_inputs(training_args={**base, "max_length": None}, overrides={"model": "tiny-llama"}).seq_len \
        == TrainingSpec(model="tiny-llama").seq_len
    with pytest.raises(SpecError, match="max_length"):
        spec_from_inputs(training_args={**base, "max_length": -4}, overrides={"model": "tiny-llama"})
