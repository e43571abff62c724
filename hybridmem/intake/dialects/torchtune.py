"""torchtune's recipe YAML (`tune run RECIPE --config FILE`), read as torchtune's recipes read it.

A torchtune config names its model by a builder (`model: {_component_:
torchtune.models.llama3_2.lora_llama3_2_3b, lora_rank: 64, ...}`: torchtune/models/*/
_model_builders.py, the `lora_` / `qlora_` builders taking lora_attn_modules, apply_lora_to_mlp
False, apply_lora_to_output False, lora_rank 8, lora_alpha 16, lora_dropout 0.0, use_dora False,
quantize_base False); the recipe (recipes/lora_finetune_single_device.py,
full_finetune_single_device.py and their _distributed twins) reads the rest: batch_size,
gradient_accumulation_steps, dtype, enable_activation_checkpointing /
enable_activation_offloading (default False), optimizer_in_bwd, clip_grad_norm, loss,
optimizer. The recipes run the model in `dtype` everywhere (`training.set_default_dtype`, "all
activations, gradients and optimizer states are in bfloat16"): adapters too (`adapter_dtype`;
DoRA / QLoRA adapters are priced fp32 with a warning). After the forward the recipes `del` the logits before
backward: only the loss outlives it (loop `trainer`). `dataset.packed` packs samples into rows
of max_seq_len tokens (datasets/_packed.py), the padded batch's tokens per row, masked per
sample by flex attention's BlockMask on CUDA: priced as the padded batch.

torchtune's module names map onto transformers' (q_proj, k_proj, v_proj; output_proj = o_proj;
w1 / w3 / w2 = gate_proj / up_proj / down_proj; output = lm_head).
"""

from __future__ import annotations

from pathlib import Path

from hybridmem.errors import SpecError
from hybridmem.job import schema
from hybridmem.intake import config_keys
from hybridmem.intake.readers.common import typed_value
from hybridmem.intake.dialects.common import Layer, LauncherConfig, flag, model_of

NAME = "torchtune"
SOURCE = "torchtune"
DETECT_ORDER = 10  # tried first: the model's `_component_` is torchtune's alone

# model builder (torchtune/models/<family>/_model_builders.py, without its lora_ / qlora_
# prefix) -> the checkpoint it loads, by hub id (`hybridmem.models.hub` names its preset)
BUILDERS: dict[str, str] = {
    "llama3_2_1b": "meta-llama/Llama-3.2-1B", "llama3_2_3b": "meta-llama/Llama-3.2-3B",
    "llama3_1_8b": "meta-llama/Llama-3.1-8B", "llama3_1_70b": "meta-llama/Llama-3.1-70B",
    "llama3_1_405b": "meta-llama/Llama-3.1-405B", "llama3_8b": "meta-llama/Meta-Llama-3-8B",
    "llama3_70b": "meta-llama/Meta-Llama-3-70B", "llama2_7b": "meta-llama/Llama-2-7b-hf",
    "llama2_13b": "meta-llama/Llama-2-13b-hf", "llama2_70b": "meta-llama/Llama-2-70b-hf",
    "mistral_7b": "mistralai/Mistral-7B-v0.1", "gemma2_2b": "google/gemma-2-2b",
    "gemma2_9b": "google/gemma-2-9b", "gemma2_27b": "google/gemma-2-27b",
    "phi3_mini": "microsoft/Phi-3-mini-4k-instruct", "phi4_14b": "microsoft/phi-4",
    "qwen2_0_5b": "Qwen/Qwen2-0.5B", "qwen2_1_5b": "Qwen/Qwen2-1.5B", "qwen2_7b": "Qwen/Qwen2-7B",
    "qwen2_5_0_5b": "Qwen/Qwen2.5-0.5B", "qwen2_5_1_5b_base": "Qwen/Qwen2.5-1.5B",
    "qwen2_5_1_5b_instruct": "Qwen/Qwen2.5-1.5B-Instruct", "qwen2_5_3b": "Qwen/Qwen2.5-3B",
    "qwen2_5_7b_base": "Qwen/Qwen2.5-7B", "qwen2_5_7b_instruct": "Qwen/Qwen2.5-7B-Instruct",
    "qwen2_5_14b_base": "Qwen/Qwen2.5-14B", "qwen2_5_14b_instruct": "Qwen/Qwen2.5-14B-Instruct",
    "qwen2_5_32b_base": "Qwen/Qwen2.5-32B", "qwen2_5_32b_instruct": "Qwen/Qwen2.5-32B-Instruct",
    "qwen2_5_72b_base": "Qwen/Qwen2.5-72B", "qwen2_5_72b_instruct": "Qwen/Qwen2.5-72B-Instruct",
    "qwen3_0_6b_base": "Qwen/Qwen3-0.6B-Base", "qwen3_0_6b_instruct": "Qwen/Qwen3-0.6B",
    "qwen3_1_7b_base": "Qwen/Qwen3-1.7B-Base", "qwen3_1_7b_instruct": "Qwen/Qwen3-1.7B",
    "qwen3_4b_base": "Qwen/Qwen3-4B-Base", "qwen3_4b_instruct": "Qwen/Qwen3-4B",
    "qwen3_8b_base": "Qwen/Qwen3-8B-Base", "qwen3_8b_instruct": "Qwen/Qwen3-8B",
    "qwen3_14b_base": "Qwen/Qwen3-14B-Base", "qwen3_14b_instruct": "Qwen/Qwen3-14B",
    "qwen3_32b": "Qwen/Qwen3-32B",
    # qwen2_5_vision/_model_builders.py: the Qwen2.5-VL checkpoints its configs download
    "qwen2_5_vl_3b": "Qwen/Qwen2.5-VL-3B-Instruct", "qwen2_5_vl_7b": "Qwen/Qwen2.5-VL-7B-Instruct",
}
# torchtune module names -> transformers' (module docstring)
ATTN_MODULES: dict[str, str] = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj",
                                "output_proj": "o_proj"}
MLP_MODULES: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
# the lora builders' keyword arguments (and a vision builder's trainable flags: known)
MODEL_KEYS: tuple[str, ...] = ("_component_", "lora_attn_modules", "apply_lora_to_mlp",
                               "apply_lora_to_output", "lora_rank", "lora_alpha",
                               "lora_dropout", "use_dora", "quantize_base")
MODEL_KNOWN: frozenset[str] = frozenset({"decoder_trainable", "encoder_trainable",
                                         "fusion_trainable", "image_size", "max_seq_len"})

READ: tuple[str, ...] = ("model", "tokenizer", "dataset", "batch_size",
                         "gradient_accumulation_steps", "dtype",
                         "enable_activation_checkpointing", "enable_activation_offloading",
                         "optimizer_in_bwd", "clip_grad_norm", "loss", "optimizer", "compile",
                         "fsdp_reshard_after_forward", "fsdp_cpu_offload")
# the recipes' other config keys (recipes/*.py `cfg.` / `cfg.get`): no memory effect
KNOWN: frozenset[str] = frozenset({
    "output_dir", "checkpointer", "resume_from_checkpoint", "save_adapter_weights_only",
    "save_last_epoch_only", "seed", "shuffle", "lr_scheduler", "epochs", "max_steps_per_epoch",
    "metric_logger", "log_every_n_steps", "log_peak_memory_stats", "log_level", "device",
    "profiler", "activation_offloading_use_streams", "custom_sharded_layers", "low_cpu_ram",
    "ac_mode", "ac_option", "enable_async_checkpointing", "run_val_every_n_steps",
    "dataset_val", "batch_size_val", "tensor_parallel_dim", "tensor_parallel_plan",
    "data_parallel_shard_dim", "data_parallel_replicate_dim", "context_parallel_dim",
    "context_parallel_rotate_method", "quantizer", "cudnn_deterministic_mode", "max_steps",
    "save_every_n_steps", "keep_last_n_checkpoints", "teacher_model", "teacher_checkpointer",
    "kd_loss", "kd_ratio", "reference_model", "ref_checkpointer", "collate_fn",
    "memory_efficient_fsdp_wrap", "fsdp_sharding_strategy", "loss_parallel",
    "gradient_checkpointing", "num_training_steps", "inference", "clip_grad_norm_type",
})
# optimizer `_component_` -> ours (torch.optim.AdamW: foreach on CUDA, `fused: True` fused)
OPTIMIZERS: dict[str, str] = {
    "torch.optim.AdamW": "adamw", "torch.optim.Adam": "adamw", "torch.optim.SGD": "sgd",
    "torch.optim.Adafactor": "adafactor", "bitsandbytes.optim.AdamW8bit": "adamw-8bit",
    "bitsandbytes.optim.PagedAdamW8bit": "paged-adamw-8bit",
    "bitsandbytes.optim.PagedAdamW": "paged-adamw",
    "bitsandbytes.optim.PagedAdamW32bit": "paged-adamw", "bitsandbytes.optim.Lion": "lion-32bit",
    "bitsandbytes.optim.Lion8bit": "lion-8bit", "bitsandbytes.optim.PagedLion": "paged-lion",
    "bitsandbytes.optim.PagedLion8bit": "paged-lion-8bit",
}
# loss `_component_` -> logits chunks (torchtune/modules/loss: CEWithChunkedOutputLoss and
# LinearCrossEntropyLoss default num_output_chunks=8); plain cross-entropy: 0
LOSSES: dict[str, int | None] = {
    "torchtune.modules.loss.CEWithChunkedOutputLoss": 8,
    "torchtune.modules.loss.LinearCrossEntropyLoss": 8,
    "torch.nn.CrossEntropyLoss": 0,
}
# preference losses (torchtune/rlhf/loss/dpo.py) -> the objective their recipes run:
# lora_dpo_single_device / _distributed and full_dpo_distributed feed chosen and rejected
# through one `concatenated_forward`, the reference log-probs from the policy with its adapters
# disabled (`disable_adapter`, LoRA) or from a frozen copy (full); RSO is DPO's step with a
# hinge loss
PREFERENCE_LOSSES: dict[str, str] = {"torchtune.rlhf.loss.DPOLoss": "dpo",
                                     "torchtune.rlhf.loss.RSOLoss": "dpo",
                                     "torchtune.modules.rlhf.loss.DPOLoss": "dpo",
                                     "torchtune.modules.rlhf.loss.RSOLoss": "dpo"}
DTYPES: dict[str, str] = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32",
                          "float32": "fp32"}


def detect(cfg: dict) -> bool:
    """A model node built by a `_component_` (torchtune's config.instantiate)."""
    return isinstance(cfg.get("model"), dict) and "_component_" in cfg["model"]


def _builder(component: object, where: str) -> tuple[str, str]:
    """(base builder name, "lora" / "qlora" / "full") of a model `_component_`."""
    if not isinstance(component, str) or "." not in component:
        raise SpecError(f"{where}: model._component_", component,
                        reason="must name a torchtune model builder")
    name = component.rsplit(".", 1)[1]
    for prefix in ("qlora_", "lora_"):
        if name.startswith(prefix):
            return name[len(prefix):], prefix[:-1]
    return name, "full"


def read(raw: dict, where: str, folder: Path, model: str | None = None) -> LauncherConfig:
    """The file's layer (torchtune opens no other file that changes memory)."""
    config_keys.check_keys(SOURCE, raw, where, used=READ, known=lambda: KNOWN)
    node = raw.get("model") or {}
    config_keys.check_keys(SOURCE, node, where, prefix="model.", used=MODEL_KEYS,
                           known=lambda: MODEL_KNOWN)
    out = Layer(where, NAME)
    base, kind = _builder(node.get("_component_"), where)
    if base not in BUILDERS and model is None:
        raise SpecError(f"{where}: model._component_", node.get("_component_"),
                        reason="no preset for this builder; give --model with the checkpoint's "
                        "config.json")
    model, hub_id = model_of(BUILDERS.get(base), where, "model._component_", override=model)
    out.set("model", model, "model._component_", note=hub_id)
    _recipe(raw, out, where)
    if kind == "full":
        out.set("train", "full", "model._component_")
    else:
        _lora(node, out, where, kind)
        _adapter_dtype(raw, out, where)
    spec = out.data["spec"]
    hf = {"per_device_train_batch_size": spec.get("micro_batch", 1), "bf16": False,
          "fp16": False, "gradient_accumulation_steps": spec.get("grad_accum", 1),
          "_given": False}
    layer = out.data
    # on more than one GPU torchtune runs a _distributed recipe, which shards the model with
    # FSDP2 (`training.shard_model`, fully_shard); it has no DDP recipe
    layer["multi_gpu_strategy"] = "fsdp"
    return LauncherConfig(NAME, model, [layer], hf)


def _lora(node: dict, out: Layer, where: str, kind: str) -> None:
    out.set("train", "lora", "model._component_")
    attn = node.get("lora_attn_modules") or []
    if not isinstance(attn, list) or any(m not in ATTN_MODULES for m in attn):
        raise SpecError(f"{where}: model.lora_attn_modules", attn, sorted(ATTN_MODULES))
    targets = [ATTN_MODULES[m] for m in attn]
    if flag(f"{where}: model.apply_lora_to_mlp", node.get("apply_lora_to_mlp", False)):
        targets += MLP_MODULES
    if flag(f"{where}: model.apply_lora_to_output", node.get("apply_lora_to_output", False)):
        targets.append("lm_head")
    if not targets:
        raise SpecError(f"{where}: model.lora_attn_modules", attn,
                        reason="no LoRA target: name attention modules or apply_lora_to_mlp")
    keys = [f"model.{k}" for k in ("lora_attn_modules", "apply_lora_to_mlp",
                                   "apply_lora_to_output") if k in node]
    out.set("lora_targets", tuple(targets), *keys)
    for key, field, default in (("lora_rank", "lora_r", 8), ("lora_alpha", "lora_alpha", 16.0),
                                ("lora_dropout", "lora_dropout", 0.0)):
        if node.get(key) is not None:
            value = typed_value(f"{where}: model.{key}", schema.BY_KEY[field], node[key])
            out.set(field, value, f"model.{key}")
        else:
            out.set(field, default)
    if node.get("use_dora") is not None:
        out.set("lora_use_dora", flag(f"{where}: model.use_dora", node["use_dora"]),
                "model.use_dora")
    if kind == "qlora" or (node.get("quantize_base") and flag(f"{where}: model.quantize_base",
                                                              node["quantize_base"])):
        # torchao NF4Tensor (torchtune modules/peft/lora.py, FrozenNF4Linear for the other
        # linears): block 64, int8 scalers per block with an fp32 factor per 256 blocks, the
        # bytes of bitsandbytes NF4 with double quantisation; every linear but the output;
        # computed in the model dtype, no kbit preparation
        key = "model._component_" if kind == "qlora" else "model.quantize_base"
        out.set("quantize", "nf4", key)
        out.set("quant_double_quant", True, key)
        out.set("kbit_prep", False, key)


def _adapter_dtype(raw: dict, out: Layer, where: str) -> None:
    """torchtune's LoRALinear builds lora_a / lora_b as plain nn.Linear under the recipe's
    default dtype (torchtune/modules/peft/lora.py; `training.set_default_dtype(dtype)` around
    the model build): adapters in `dtype`, priced so (`adapter_dtype`) for plain LoRA. DoRA
    and QLoRA adapters in half precision are not priced: PEFT's fp32 ones, with a warning."""
    spec = out.data["spec"]
    if spec["precision"] == "fp32":
        return
    if out.data["lora"].get("use_dora") or spec.get("quantize", "none") != "none":
        config_keys.warn(f"{where}: torchtune keeps DoRA / QLoRA adapters in the model dtype; "
                         "priced with PEFT's fp32 adapters (an upper bound, by the adapters' "
                         "fp32 inputs)")
        return
    out.set("adapter_dtype", spec["precision"], *(("dtype",) if "dtype" in raw else ()),
            note="torchtune LoRALinear: adapters in the model dtype")


def _recipe(raw: dict, out: Layer, where: str) -> None:
    """The recipe's keys (module docstring)."""
    dtype = str(raw.get("dtype", "bf16"))  # the configs say bf16; recipes refuse fp16
    if dtype not in DTYPES:
        raise SpecError(f"{where}: dtype", dtype, sorted(DTYPES),
                        reason="torchtune's recipes train in bf16 or fp32")
    out.set("precision", DTYPES[dtype], *(("dtype",) if "dtype" in raw else ()))
    if raw.get("batch_size") is not None:
        out.set("micro_batch", typed_value(f"{where}: batch_size", schema.BY_KEY["micro_batch"],
                                           raw["batch_size"]), "batch_size")
    if raw.get("gradient_accumulation_steps") is not None:
        out.set("grad_accum", typed_value(f"{where}: gradient_accumulation_steps",
                                          schema.BY_KEY["grad_accum"],
                                          raw["gradient_accumulation_steps"]),
                "gradient_accumulation_steps")
    length = (raw.get("tokenizer") or {}).get("max_seq_len")
    if length is not None:
        out.set("seq_len", typed_value(f"{where}: tokenizer.max_seq_len",
                                       schema.BY_KEY["seq_len"], length), "tokenizer.max_seq_len")
    else:
        config_keys.warn(f"{where}: torchtune key 'tokenizer.max_seq_len' is null: samples are "
                         "not truncated; give --seq-len (the longest sample, in tokens)")
    for key, field in (("enable_activation_checkpointing", "grad_ckpt"),
                       ("optimizer_in_bwd", "optimizer_in_backward")):
        if raw.get(key) is not None:
            out.set(field, flag(f"{where}: {key}", raw[key]), key)
    if raw.get("enable_activation_offloading") and flag(f"{where}: enable_activation_offloading",
                                                        raw["enable_activation_offloading"]):
        # training.get_act_offloading_ctx_manager: the OffloadActivations TRL copied
        out.set("offload_activations", "all", "enable_activation_offloading")
    if raw.get("clip_grad_norm") is not None:  # null: no clipping
        out.set("max_grad_norm", typed_value(f"{where}: clip_grad_norm",
                                             schema.BY_KEY["max_grad_norm"],
                                             raw["clip_grad_norm"]), "clip_grad_norm")
    out.set("loop", "trainer")
    _loss(raw.get("loss"), out, where)
    _optimizer(raw.get("optimizer"), out, where)
    if raw.get("compile") and flag(f"{where}: compile", raw["compile"]):
        config_keys.warn(f"{where}: torchtune key 'compile'=True is not priced; torch.compile "
                         "changes which activations are saved")
    if raw.get("fsdp_cpu_offload") and flag(f"{where}: fsdp_cpu_offload", raw["fsdp_cpu_offload"]):
        raise SpecError(f"{where}: fsdp_cpu_offload", True, [False],
                        reason="FSDP CPU offload is not modelled")
    if raw.get("fsdp_reshard_after_forward") is not None:
        out.set("reshard_after_forward", flag(f"{where}: fsdp_reshard_after_forward",
                                              raw["fsdp_reshard_after_forward"]),
                "fsdp_reshard_after_forward")


def _loss(node: object, out: Layer, where: str) -> None:
    if node is None:
        return
    component = node.get("_component_") if isinstance(node, dict) else None
    if component in PREFERENCE_LOSSES:
        out.set("objective", PREFERENCE_LOSSES[component], "loss._component_")
        out.set("beta", typed_value(f"{where}: loss.beta", schema.BY_KEY["beta"],
                                    node.get("beta", 0.1)),  # DPOLoss(beta=0.1)
                *(("loss.beta",) if "beta" in node else ()))
        return
    if component not in LOSSES:
        raise SpecError(f"{where}: loss._component_", component,
                        sorted((*LOSSES, *PREFERENCE_LOSSES)), reason="this loss is not priced")
    chunks = node.get("num_output_chunks", LOSSES[component])
    if chunks:
        out.set("chunked_ce", typed_value(f"{where}: loss.num_output_chunks",
                                          schema.BY_KEY["chunked_ce"], chunks), "loss._component_")
    if component.endswith("LinearCrossEntropyLoss"):
        config_keys.warn(f"{where}: torchtune's LinearCrossEntropyLoss is priced as "
                         "CEWithChunkedOutputLoss with the same chunks (an upper bound: it "
                         "projects each chunk of hidden states inside the loss)")


def _optimizer(node: object, out: Layer, where: str) -> None:
    if node is None:
        return
    component = node.get("_component_") if isinstance(node, dict) else None
    if component not in OPTIMIZERS:
        raise SpecError(f"{where}: optimizer._component_", component, sorted(OPTIMIZERS),
                        reason="this optimizer is not priced")
    name = OPTIMIZERS[component]
    if name == "adamw" and node.get("fused"):
        name = "adamw-fused"
    if name == "sgd" and node.get("momentum"):
        name = "sgd-momentum"
    out.set("optimizer", name, "optimizer._component_")
