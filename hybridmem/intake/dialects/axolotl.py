"""axolotl's training YAML (`axolotl train FILE`), read as axolotl reads it.

axolotl validates the file against `AxolotlInputConfig` (src/axolotl/utils/schemas/config.py and
the models it extends: model.py, peft.py, training.py, integrations.py, multimodal.py,
deprecated.py, fsdp.py), normalises it (utils/config/__init__.py `normalize_config`) and loads
the model (loaders/model.py `ModelLoader`). The keys read here, their defaults and effects are
cited beside each rule.

Precision (`normalize_config`: `torch_dtype` = bf16 if `bf16` or `bfloat16`, fp16 if
`load_in_8bit` or `fp16` or `float16`, else fp32; `bf16` defaults to "auto", on for a
bf16-capable GPU, which the GPU catalogue's all are; the model is loaded in `torch_dtype`,
`ModelLoader._set_device_map_config`): full fine-tuning trains the weights in that dtype
(`bf16`, `fp16`, `fp32` here); LoRA / QLoRA keep the base in it with PEFT's fp32 adapters
(`peft_autocast_adapter_dtype` unset = PEFT's default True; False: `adapter_dtype` in the
model dtype), `bf16` etc. here. `bf16` is also Trainer's own flag (`_autocast`): on one
process, bf16 autocast over the bf16 weights = `bf16-autocast`.
"""

from __future__ import annotations

import os
from pathlib import Path

from hybridmem import objectives
from hybridmem.errors import SpecError
from hybridmem.job import schema
from hybridmem.job.optimizers import from_hf
from hybridmem.job.spec import DEFAULT_LORA_TARGETS
from hybridmem.jsonfile import read_json_object
from hybridmem.intake import config_keys
from hybridmem.intake.readers import fsdp as fsdp_config
from hybridmem.intake.readers.common import typed_value
from hybridmem.intake.readers.trainer import HF_DEFAULT_MAX_GRAD_NORM, fsdp_options
from hybridmem.intake.dialects.common import (
    Layer,
    LauncherConfig,
    flag,
    is_multimodal,
    local_file,
    model_of,
    names,
)

NAME = "axolotl"
SOURCE = "axolotl"
DETECT_ORDER = 20  # after torchtune: axolotl's `base_model` marker

READ: tuple[str, ...] = (
    "base_model", "adapter", "load_in_4bit", "load_in_8bit", "bnb_config_kwargs", "lora_r",
    "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_linear",
    "lora_modules_to_save", "peft_use_dora", "peft_use_rslora", "sequence_len",
    "sample_packing", "micro_batch_size", "gradient_accumulation_steps", "batch_size",
    "optimizer", "optim_args", "max_grad_norm", "bf16", "fp16", "bfloat16", "float16",
    "float32", "gradient_checkpointing", "gradient_checkpointing_kwargs",
    "activation_offloading", "flash_attention", "sdp_attention", "eager_attention",
    "attn_implementation", "attention", "liger_rope", "liger_rms_norm", "liger_layer_norm",
    "liger_swiglu", "liger_glu_activation", "liger_cross_entropy",
    "liger_fused_linear_cross_entropy", "deepspeed", "fsdp", "fsdp_config", "fsdp_version",
    "world_size", "image_size", "group_by_length", "seed", "max_steps",
    "rl", "trl", "rl_beta", "dpo_beta", "precompute_ref_log_probs",
)

# The other fields of AxolotlInputConfig and the models it extends (utils/schemas/*.py),
# plugin args (integrations/*/args.py), and names of earlier releases: known, no memory
# effect (or warned below when they have one that is not priced).
KNOWN: frozenset[str] = frozenset({
    # model.py ModelInputConfig / ModelOutputConfig; deprecated.py RemappedParameters
    "base_model_config", "cls_model_config", "tokenizer_config", "tokenizer_use_fast",
    "tokenizer_legacy", "tokenizer_use_mistral_common", "tokenizer_type", "processor_type",
    "tokenizer_save_jinja_files", "trust_remote_code", "experimental_skip_move_to_device",
    "use_kernels", "model_quantization_config", "model_quantization_config_kwargs",
    "output_dir", "hub_model_id", "hub_strategy", "hub_revision", "save_safetensors",
    "model_config", "model_kwargs", "model_type", "model_revision", "overrides_of_model_config",
    "overrides_of_model_kwargs", "type_of_model", "revision_of_model", "model_config_type",
    # peft.py LoraConfig / ReLoRAConfig
    "lora_model_dir", "lora_fan_in_fan_out", "lora_target_parameters", "lora_exclude_modules",
    "lora_rank_pattern", "lora_alpha_pattern", "peft_layers_to_transform",
    "peft_layers_pattern", "peft", "peft_layer_replication", "peft_init_lora_weights",
    "peft_trainable_token_indices", "peft_ensure_weight_tying", "peft_autocast_adapter_dtype",
    "qlora_sharded_model_loading", "lora_on_cpu", "gptq", "gptq_disable_exllama",
    "loraplus_lr_ratio", "loraplus_lr_embedding", "merge_lora", "merge_method", "relora",
    "relora_steps", "relora_warmup_steps", "relora_anneal_steps", "relora_prune_ratio",
    "relora_prune_method", "relora_cpu_offload",
    # training.py HyperparametersConfig / JaggedLRConfig
    "eval_batch_size", "auto_find_batch_size", "train_on_inputs", "group_by_length",
    "learning_rate", "embedding_lr", "embedding_lr_scale", "weight_decay",
    "optim_target_modules", "torchdistx_path", "lr_scheduler", "lr_scheduler_kwargs",
    "lr_quadratic_warmup", "cosine_min_lr_ratio", "cosine_constant_lr_ratio", "lr_div_factor",
    "lr_groups", "adam_epsilon", "adam_epsilon2", "adam_beta1", "adam_beta2", "adam_beta3",
    "num_epochs", "jagged_restart_steps", "jagged_restart_warmup_steps",
    "jagged_restart_anneal_steps",
    # integrations.py: wandb, mlflow, comet, trackio, opentelemetry, LISA, gradio, ray
    "use_wandb", "wandb_name", "wandb_run_id", "wandb_mode", "wandb_project", "wandb_entity",
    "wandb_watch", "wandb_log_model", "use_mlflow", "mlflow_tracking_uri",
    "mlflow_experiment_name", "mlflow_run_name", "hf_mlflow_log_artifacts", "use_comet",
    "comet_api_key", "comet_workspace", "comet_project_name", "comet_experiment_key",
    "comet_mode", "comet_online", "comet_experiment_config", "use_trackio", "trackio_project",
    "trackio_run_name", "trackio_space_id", "use_otel_metrics", "otel_metrics_host",
    "otel_metrics_port", "lisa_n_layers", "lisa_step_interval", "lisa_layers_attribute",
    "gradio_title", "gradio_share", "gradio_server_name", "gradio_server_port",
    "gradio_max_new_tokens", "gradio_temperature", "use_ray", "ray_run_name",
    "ray_num_workers", "resources_per_worker",
    # multimodal.py
    "image_resize_algorithm",
    # config.py AxolotlInputConfig
    "strict", "resume_from_checkpoint", "auto_resume_from_checkpoints",
    "resize_token_embeddings_to_32x", "mean_resizing_embeddings", "shrink_embeddings",
    "embeddings_skip_upcast", "reinit_weights", "random_init_weights", "trainer_cls", "rl",
    "trl", "vllm", "ebft", "qat", "quantization", "reward_model", "dynamic_checkpoint",
    "process_reward_model", "center_rewards_coefficient", "num_labels", "dpo_use_weighting",
    "dpo_label_smoothing", "precompute_ref_log_probs", "dpo_use_liger_kernel",
    "dpo_padding_free", "dpo_loss_type", "dpo_loss_weights", "datasets", "test_datasets",
    "shuffle_merged_datasets", "shuffle_before_merging_datasets", "dataset_prepared_path",
    "dataset_shard_num", "dataset_shard_idx", "skip_prepare_dataset",
    "num_dataset_shards_to_save", "pretraining_dataset", "dataset_processes",
    "dataset_num_proc", "dataset_exact_deduplication", "dataset_keep_in_memory",
    "dataloader_pin_memory", "dataloader_num_workers", "dataloader_prefetch_factor",
    "dataloader_drop_last", "accelerator_config", "remove_unused_columns",
    "push_dataset_to_hub", "hf_use_auth_token", "device", "device_map", "local_rank", "ddp",
    "seed", "ddp_timeout", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
    "ddp_find_unused_parameters", "do_causal_lm_eval", "eval_causal_lm_metrics",
    "do_bench_eval", "bench_dataset", "bench_split", "metric_for_best_model",
    "greater_is_better", "loss_watchdog_threshold", "loss_watchdog_patience", "gc_steps",
    "fp8", "fp8_enable_fsdp_float8_all_gather", "tf32", "layer_offloading",
    "freeze_mm_modules", "unfrozen_parameters", "excess_length_strategy", "eval_sequence_len",
    "min_sample_len", "max_prompt_len", "sample_packing_group_size", "sample_packing_bin_size",
    "sample_packing_sequentially", "sample_packing_mp_start_method", "eval_sample_packing",
    "pad_to_sequence_len", "pad_to_multiple_of", "curriculum_sampling",
    "multipack_real_batches", "batch_flattening", "use_pose", "pose_split_on_token_ids",
    "pose_max_context_len", "pose_num_chunks", "pretrain_multipack_buffer_size",
    "pretrain_multipack_attn", "pretraining_sample_concatenation", "streaming",
    "streaming_multipack_buffer_size", "xformers_attention", "s2_attention", "flex_attention",
    "flex_attn_compile_kwargs", "flash_attn_cross_entropy", "flash_attn_rms_norm",
    "flash_attn_fuse_qkv", "flash_attn_fuse_mlp", "flash_optimum", "sage_attention",
    "gemma4_hybrid_attn_impl", "experts_implementation", "quantize_moe_experts",
    "scaling_softmax", "scaling_softmax_factor", "scaling_softmax_bias",
    "unsloth_cross_entropy_loss", "unsloth_lora_mlp", "unsloth_lora_qkv", "unsloth_lora_o",
    "unsloth_rms_norm", "unsloth_rope", "lora_mlp_kernel", "lora_qkv_kernel",
    "lora_o_kernel", "lora_embedding_kernel", "chunked_cross_entropy",
    "chunked_cross_entropy_num_chunks", "use_eaft", "eaft_alpha", "eaft_k", "tiled_mlp",
    "tiled_mlp_num_shards", "tiled_mlp_use_original_mlp", "llama4_linearized_experts",
    "deepcompile", "fsdp_final_state_dict_type", "val_set_size", "dp_shard_size",
    "dp_replicate_size", "sequence_parallel_degree", "context_parallel_size",
    "heads_k_stride", "ring_attn_func", "tensor_parallel_size", "special_tokens", "tokens",
    "added_tokens_overrides", "torch_compile", "torch_compile_backend", "torch_compile_mode",
    "max_steps", "warmup_steps", "warmup_ratio", "eval_steps", "evals_per_epoch",
    "eval_strategy", "evaluation_strategy", "save_steps", "saves_per_epoch", "save_strategy",
    "save_total_limit", "save_first_step", "logging_steps", "early_stopping_patience",
    "load_best_model_at_end", "save_only_model", "use_tensorboard", "profiler_steps",
    "profiler_steps_start", "include_tokens_per_second", "include_tkps",
    "neftune_noise_alpha", "noisy_embedding_alpha", "orpo_alpha", "rpo_alpha", "simpo_gamma",
    "cpo_alpha", "kto_desirable_weight", "kto_undesirable_weight", "rl_beta", "dpo_beta",
    "max_memory", "gpu_memory_limit", "low_cpu_mem_usage", "chat_template",
    "chat_template_jinja", "chat_template_kwargs", "eot_tokens", "default_system_message",
    "fix_untrained_tokens", "is_preprocess", "preprocess_iterable", "total_num_tokens",
    "total_supervised_tokens", "sample_packing_eff_est", "axolotl_config_path",
    "is_falcon_derived_model", "is_llama_derived_model", "is_mistral_derived_model",
    "is_qwen_derived_model", "plugins", "generate_samples", "num_generation_samples",
    "generation_max_new_tokens", "generation_temperature", "generation_top_p",
    "generation_top_k", "generation_prompt_ratio", "generation_do_sample",
    "max_packed_sequence_len", "rope_scaling", "eval_table_size", "eval_max_new_tokens",
    "dpo_use_logits_to_keep", "dpo_generate_during_eval", "dpo_norm_loss", "debug",
    "cut_cross_entropy", "overrides_of_model_config",
})

# keys with a memory effect this reader does not price, warned when set (true, non-empty, or a
# size other than the neutral one): (the value that changes nothing, advice)
UNPRICED: dict[str, tuple[object, str]] = {
    "unfrozen_parameters": (None, "training a subset of the weights is not priced"),
    "freeze_mm_modules": (None, "freezing the vision tower and projector is not priced"),
    "chunked_cross_entropy": (None, "axolotl's chunked cross-entropy is not priced"),
    "tiled_mlp": (None, "ALST tiled MLP is not priced"),
    "layer_offloading": (False, "layer offloading is not priced"),
    "lora_mlp_kernel": (None, "axolotl's LoRA kernels are not priced"),
    "lora_qkv_kernel": (None, "axolotl's LoRA kernels are not priced"),
    "lora_o_kernel": (None, "axolotl's LoRA kernels are not priced"),
    "torch_compile": (None, "torch.compile is not priced"),
    "fp8": (None, "FP8 training is not priced"),
    "context_parallel_size": (1, "context parallelism is not priced"),
    "sequence_parallel_degree": (1, "sequence parallelism is not priced"),
    "tensor_parallel_size": (1, "tensor parallelism is not priced"),
    "relora": (None, "ReLoRA is not priced"),
    "qat": (None, "quantisation-aware training is not priced"),
}

# attention keys (config.py: the legacy flags, `attn_implementation`; loaders/model.py
# `_set_attention_config`); unset = transformers' own choice
ATTN_FLAGS: dict[str, str] = {"flash_attention": "flash_attention_2", "sdp_attention": "sdpa",
                              "eager_attention": "eager"}
ATTN_NAMES: dict[str, str] = {"flash_attention_2": "flash_attention_2", "flash": "flash_attention_2",
                              "sdpa": "sdpa", "sdp": "sdpa", "eager": "eager"}
# liger plugin args (integrations/liger/args.py) -> Liger's kernel flags
# (`hybridmem.techniques.liger.LIGER_DEFAULTS`); `liger_swiglu` is glu_activation's old name
LIGER: dict[str, str] = {"liger_rope": "rope", "liger_rms_norm": "rms_norm",
                         "liger_glu_activation": "swiglu", "liger_swiglu": "swiglu",
                         "liger_cross_entropy": "cross_entropy",
                         "liger_fused_linear_cross_entropy": "fused_linear_cross_entropy"}


def detect(cfg: dict) -> bool:
    """axolotl's model key (`base_model`, model.py: required)."""
    return "base_model" in cfg


def read(raw: dict, where: str, folder: Path, model: str | None = None) -> LauncherConfig:
    """The file's layer; `folder` is where the file sits (a relative DeepSpeed path)."""
    config_keys.check_keys(SOURCE, raw, where, used=READ, known=lambda: KNOWN)
    cfg = {k: v for k, v in raw.items() if v is not None}
    config_keys.unpriced(SOURCE, {k: v for k, v in cfg.items() if v}, where, UNPRICED)
    model, hub_id = model_of(raw.get("base_model"), where, "base_model", override=model)
    out = Layer(where, NAME)
    out.set("model", model, "base_model", note=hub_id)
    if cfg.get("adapter") and cfg.get("lora_target_linear") and is_multimodal(model):
        config_keys.warn(f"{where}: axolotl key 'lora_target_linear' also adapts the vision "
                         "tower's and projector's linears, which are not priced (the LLM's "
                         "are); give --lora-targets")
    dtype, dtype_keys = _dtype(cfg, where)
    _training(cfg, out, where, dtype, dtype_keys)
    if cfg.get("peft_autocast_adapter_dtype") is False:
        _half_adapters(out, where)
    _batch(cfg, out, where)
    _sampler(cfg, out, where)
    _savers(cfg, out, where)
    _packing_mask(out, where)
    _optimizer(cfg, out, where)
    _objective(cfg, out, where)
    deepspeed, ds_where = _parallel(cfg, out, where, folder)
    _autocast(out, dtype, dtype_keys, deepspeed)
    spec = out.data["spec"]
    hf = {"per_device_train_batch_size": spec["micro_batch"], "bf16": dtype == "bf16",
          "fp16": dtype == "fp16", "gradient_accumulation_steps": spec["grad_accum"],
          "_given": "micro_batch_size" in cfg}
    return LauncherConfig(NAME, model, [out.data], hf, deepspeed, ds_where)


def _dtype(cfg: dict, where: str) -> tuple[str, tuple[str, ...]]:
    """`normalize_config`'s torch_dtype, as bf16 / fp16 / fp32, and the keys that set it."""
    bf16 = cfg.get("bf16", "auto")  # config.py: default "auto"
    fp16 = flag(f"{where}: fp16", cfg.get("fp16", False))
    if bf16 == "auto":  # on where the GPU has bf16, unless fp16 is asked for
        bf16 = not fp16
    if flag(f"{where}: bf16", bf16) or flag(f"{where}: bfloat16", cfg.get("bfloat16", False)):
        return "bf16", tuple(k for k in ("bf16", "bfloat16") if k in cfg)
    if cfg.get("load_in_8bit") or fp16 or cfg.get("float16"):
        return "fp16", tuple(k for k in ("load_in_8bit", "fp16", "float16") if cfg.get(k))
    return "fp32", tuple(k for k in ("bf16", "float32") if k in cfg)


def _autocast(out: Layer, dtype: str, dtype_keys: tuple, deepspeed) -> None:
    """Trainer's own `bf16` (core/builders/base.py `_configure_precision_settings`:
    `bf16 = cfg.bf16 or cfg.bfloat16`): bf16 autocast over the bf16-loaded model =
    `bf16-autocast`. Priced so without FSDP or DeepSpeed (which own the precision there) and
    with PEFT's fp32 adapters (half adapters under autocast are priced as the pure `bf16`
    run)."""
    spec = out.data["spec"]
    if dtype != "bf16" or deepspeed is not None \
            or spec.get("adapter_dtype", "fp32") != "fp32" \
            or out.data.get("parallel", {}).get("strategy", "none") != "none":
        return
    out.set("precision", "bf16-autocast", *dtype_keys,
            note="Trainer bf16=True: autocast over the bf16 weights")


def _half_adapters(out: Layer, where: str) -> None:
    """`peft_autocast_adapter_dtype: false` (get_peft_model's `autocast_adapter_dtype`): the
    adapters stay in the model dtype, priced so for plain LoRA in bf16 / fp16
    (`adapter_dtype`); elsewhere PEFT's fp32 adapters are priced, with a warning."""
    spec = out.data["spec"]
    if spec.get("train") == "lora" and spec["precision"] in ("bf16", "fp16") \
            and not out.data["lora"].get("use_dora") and spec.get("quantize", "none") == "none":
        out.set("adapter_dtype", spec["precision"], "peft_autocast_adapter_dtype")
        return
    config_keys.warn(f"{where}: axolotl key 'peft_autocast_adapter_dtype'=False is not priced "
                     "here (half adapters: plain LoRA in bf16 / fp16 only); adapters in the "
                     "model dtype are priced as PEFT's fp32 ones")


def _training(cfg: dict, out: Layer, where: str, dtype: str, dtype_keys: tuple) -> None:
    """`adapter` (peft.py: unset = full fine-tuning; lora, qlora), the LoRA settings
    (loaders/adapter.py `_build_peft_lora_config`) and the quantised base
    (loaders/model.py `_set_quantization_config`)."""
    adapter = cfg.get("adapter") or None
    if adapter not in (None, "lora", "qlora"):
        raise SpecError(f"{where}: adapter", adapter, ["lora", "qlora"],
                        reason="only LoRA adapters are priced")
    out.set("precision", dtype, *dtype_keys)
    if adapter is None:
        if cfg.get("load_in_4bit") or cfg.get("load_in_8bit"):  # peft.py validate_adapter
            raise SpecError(f"{where}: load_in_4bit", True, reason="axolotl quantises only "
                            "with an adapter (lora / qlora)")
        out.set("train", "full")
        return
    out.set("train", "lora", "adapter")
    _lora(cfg, out, where)
    four = flag(f"{where}: load_in_4bit", cfg.get("load_in_4bit", False))
    eight = flag(f"{where}: load_in_8bit", cfg.get("load_in_8bit", False))
    if adapter == "qlora" and not four:  # peft.py validate_qlora
        raise SpecError(f"{where}: load_in_4bit", False, [True],
                        reason="axolotl's qlora needs load_in_4bit: true")
    if four and adapter == "qlora":
        torch_name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
        bnb = {"load_in_4bit": True, "llm_int8_threshold": 6.0,
               "llm_int8_has_fp16_weight": False, "bnb_4bit_compute_dtype": torch_name,
               "bnb_4bit_use_double_quant": True, "bnb_4bit_quant_type": "nf4",
               "bnb_4bit_quant_storage": "bfloat16", **(cfg.get("bnb_config_kwargs") or {})}
        keys = ("adapter", "load_in_4bit") + (("bnb_config_kwargs",)
                                             if cfg.get("bnb_config_kwargs") else ())
    elif eight and adapter == "lora":
        bnb, keys = {"load_in_8bit": True}, ("load_in_8bit",)
    elif four or eight:
        raise SpecError(f"{where}: adapter", adapter, ["qlora" if four else "lora"],
                        reason="axolotl loads 4-bit for qlora, 8-bit for lora")
    else:
        return
    from hybridmem.techniques.quantize import from_bnb_config

    for key, value in from_bnb_config(bnb, f"{where}: bnb").items():
        out.set(key, value, *keys)
    # `_configure_embedding_dtypes` runs peft's prepare_model_for_kbit_training (its fp32
    # upcast of every non-quantised weight), then, for an adapter, casts every "norm" module
    # and the embedding / lm_head back to torch_dtype (`_convert_embedding_modules_dtype`):
    # no fp32 copy remains, as without the preparation
    out.set("kbit_prep", False, "adapter")


def _lora(cfg: dict, out: Layer, where: str) -> None:
    """`LoraConfig(r=lora_r, lora_alpha=lora_alpha, target_modules=..., lora_dropout=...)`;
    `lora_target_linear` adds `find_all_linear_names` (every linear but the output embedding:
    the LLM's linears, our default targets, for a decoder; a VLM's vision linears are not
    priced) to `lora_target_modules`. A string `lora_target_modules` alone reaches LoraConfig as
    a string, which PEFT full-matches as a regex (`lora.target_regex`); a list, or a string with
    `lora_target_linear` (joined into one list), is matched by name."""
    for key, field in (("lora_r", "lora_r"), ("lora_alpha", "lora_alpha"),
                       ("lora_dropout", "lora_dropout")):
        if cfg.get(key) is not None:
            out.set(field, typed_value(f"{where}: {key}", schema.BY_KEY[field], cfg[key]), key)
    given = cfg.get("lora_target_modules")
    linear = bool(cfg.get("lora_target_linear")) and flag(f"{where}: lora_target_linear",
                                                          cfg["lora_target_linear"])
    modules = ((given,) if isinstance(given, str) else
               names(given, f"{where}: lora_target_modules")) if given else ()
    if isinstance(given, str) and given.strip() and not linear:
        out.set("lora_target_regex", given, "lora_target_modules")
    elif linear:
        extra = tuple(m for m in modules if m not in DEFAULT_LORA_TARGETS)
        if extra:
            out.set("lora_targets", DEFAULT_LORA_TARGETS + extra, "lora_target_linear",
                    "lora_target_modules")
        else:
            out.set("lora_targets", DEFAULT_LORA_TARGETS, "lora_target_linear")
    elif modules:
        out.set("lora_targets", modules, "lora_target_modules")
    else:
        raise SpecError(f"{where}: lora_target_modules", None, reason="no LoRA target: give "
                        "lora_target_modules or lora_target_linear: true")
    if cfg.get("lora_modules_to_save"):
        out.set("lora_modules_to_save", names(cfg["lora_modules_to_save"],
                                              f"{where}: lora_modules_to_save"),
                "lora_modules_to_save")
    for key, field in (("peft_use_dora", "lora_use_dora"), ("peft_use_rslora", "lora_use_rslora")):
        if cfg.get(key) is not None:
            out.set(field, flag(f"{where}: {key}", cfg[key]), key)


def _batch(cfg: dict, out: Layer, where: str) -> None:
    """training.py: micro_batch_size 1, gradient_accumulation_steps 1 (`normalize_config`
    derives the accumulation from batch_size / micro_batch_size when only those are given);
    config.py: sequence_len 512. `sample_packing` packs samples into each of the micro-batch's
    rows of sequence_len tokens (utils/samplers/multipack.py `MultipackBatchSampler`, the
    collator's position ids restarting per sample: utils/collators/batching.py
    `V2BatchSamplerDataCollatorForSeq2Seq`): the job's `packing` (`techniques.packing`: the
    micro-batch's tokens with per-sample position ids). With flash-attention varlen that is
    the same memory; sdpa / eager build one mask per row, which `packing` prices over all the
    micro-batch's tokens (an upper bound, warned)."""
    micro = typed_value(f"{where}: micro_batch_size", schema.BY_KEY["micro_batch"],
                        cfg.get("micro_batch_size", 1))
    out.set("micro_batch", micro, *(("micro_batch_size",) if "micro_batch_size" in cfg else ()))
    if cfg.get("gradient_accumulation_steps") is not None:
        out.set("grad_accum", typed_value(f"{where}: gradient_accumulation_steps",
                                          schema.BY_KEY["grad_accum"],
                                          cfg["gradient_accumulation_steps"]),
                "gradient_accumulation_steps")
    elif cfg.get("batch_size") is not None:
        out.set("grad_accum", max(1, int(cfg["batch_size"]) // micro), "batch_size",
                note="batch_size / micro_batch_size")
    else:
        out.set("grad_accum", 1)
    length = cfg.get("sequence_len", 512)
    out.set("seq_len", typed_value(f"{where}: sequence_len", schema.BY_KEY["seq_len"], length),
            *(("sequence_len",) if "sequence_len" in cfg else ()))
    if cfg.get("sample_packing") is not None:
        packing = flag(f"{where}: sample_packing", cfg["sample_packing"])
        out.set("packing", packing, "sample_packing")
    if cfg.get("image_size") is not None:  # multimodal.py: an int or (width, height)
        size = cfg["image_size"]
        if isinstance(size, (list, tuple)) and len(size) == 2:
            size = f"{size[1]}x{size[0]}"
        out.set("image_size", size, "image_size")


def _packing_mask(out: Layer, where: str) -> None:
    """`_batch`'s upper bound: packed rows under sdpa / eager with a micro-batch above one."""
    spec = out.data["spec"]
    if spec.get("packing") and spec["micro_batch"] > 1 \
            and spec.get("attn") != "flash_attention_2":
        config_keys.warn(f"{where}: axolotl key 'sample_packing'=True with micro_batch_size "
                         f"{spec['micro_batch']} and no flash_attention is priced as one packed "
                         f"row of {spec['micro_batch']} x sequence_len tokens: its attention "
                         "mask is an upper bound (axolotl masks each row apart)")


def _sampler(cfg: dict, out: Layer, where: str) -> None:
    """The sampler and run length `--lengths` follows: axolotl passes `group_by_length`,
    `seed` and `max_steps` to its TrainingArguments (core/builders/causal.py)."""
    from hybridmem.job.batching import sampler_from_hf

    sampler = sampler_from_hf(None, cfg.get("group_by_length"))
    if sampler is not None:
        out.set("sampler", sampler, "group_by_length")
    for key, field in (("seed", "seed"), ("max_steps", "max_steps")):
        if cfg.get(key) is not None:
            out.set(field, typed_value(f"{where}: {key}", schema.BY_KEY[field], cfg[key]), key)


def _savers(cfg: dict, out: Layer, where: str) -> None:
    """`gradient_checkpointing` (config.py: false, true, "offload" / "offload_disk": the
    checkpointed layers' inputs moved off the GPU, monkeypatch/gradient_checkpointing),
    `activation_offloading` (true / "legacy" / "disk": every saved activation moved off the GPU,
    torchtune's OffloadActivations as TRL's), attention, Liger."""
    ckpt = cfg.get("gradient_checkpointing", False)
    if ckpt in ("offload", "offload_disk"):
        out.set("grad_ckpt", True, "gradient_checkpointing")
        out.set("offload_activations", "ckpt-inputs", "gradient_checkpointing")
    elif ckpt is not False or "gradient_checkpointing" in cfg:
        out.set("grad_ckpt", flag(f"{where}: gradient_checkpointing", ckpt),
                "gradient_checkpointing")
    offload = cfg.get("activation_offloading", False)
    if offload in ("legacy", "disk") or (offload is not False and flag(
            f"{where}: activation_offloading", offload)):
        out.set("offload_activations", "all", "activation_offloading")
    for key, attn in ATTN_FLAGS.items():
        if cfg.get(key) and flag(f"{where}: {key}", cfg[key]):
            out.set("attn", attn, key)
    for key in ("attn_implementation", "attention"):
        if cfg.get(key) is not None:
            if str(cfg[key]) not in ATTN_NAMES:
                raise SpecError(f"{where}: {key}", cfg[key], sorted(ATTN_NAMES),
                                reason="this attention implementation is not priced")
            out.set("attn", ATTN_NAMES[str(cfg[key])], key)
    given = {LIGER[k]: flag(f"{where}: {k}", cfg[k]) for k in LIGER if k in cfg}
    if any(given.values()):
        from hybridmem.techniques.liger import LIGER_DEFAULTS, check_liger_config

        # the plugin applies only the kernels set true: Liger's default set is priced
        check_liger_config({k: given.get(k, False) for k in LIGER_DEFAULTS}, f"{where}: liger")
        out.set("liger", True, *(k for k in LIGER if k in cfg))
    # integrations/cut_cross_entropy/args.py: `cut_cross_entropy` defaults to True once the
    # plugin is listed in `plugins`; without the plugin the key patches nothing
    cce_plugin = any(str(p).endswith("CutCrossEntropyPlugin") for p in cfg.get("plugins") or ())
    if cce_plugin and cfg.get("cut_cross_entropy", True) is not False:
        out.set("cut_cross_entropy", True,
                *(("cut_cross_entropy",) if "cut_cross_entropy" in cfg else ("plugins",)))


def _optimizer(cfg: dict, out: Layer, where: str) -> None:
    """training.py: `optimizer` default adamw_torch_fused (transformers OptimizerNames),
    `optim_args`; `max_grad_norm` unset = TrainingArguments' 1.0 (axolotl passes it only when
    set). axolotl trains with a transformers Trainer subclass: only the loss outlives the
    forward."""
    name = str(cfg.get("optimizer", "adamw_torch_fused"))
    args = cfg.get("optim_args")
    if isinstance(args, dict):
        args = ",".join(f"{k}={v}" for k, v in args.items())
    out.set("optimizer", from_hf(name, args), *(("optimizer",) if "optimizer" in cfg else ()))
    norm = cfg.get("max_grad_norm", HF_DEFAULT_MAX_GRAD_NORM)
    out.set("max_grad_norm", typed_value(f"{where}: max_grad_norm", schema.BY_KEY["max_grad_norm"],
                                         norm),
            *(("max_grad_norm",) if "max_grad_norm" in cfg else ()))
    out.set("loop", "trainer")


def _parallel(cfg: dict, out: Layer, where: str, folder: Path) -> tuple[dict | None, str | None]:
    """`deepspeed` (a path or an object, config.py), `fsdp` (a list of TrainingArguments fsdp
    options, deprecated) / `fsdp_config` (fsdp.py FSDPConfig; `fsdp_`-prefixed keys accepted,
    validation.py) / `fsdp_version`; `world_size` (normalize_config: $WORLD_SIZE)."""
    ws = cfg.get("world_size", os.environ.get("WORLD_SIZE"))
    if ws is not None:
        out.set("world_size", typed_value(f"{where}: world_size", schema.BY_KEY["world_size"],
                                          int(ws) if str(ws).isdigit() else ws),
                *(("world_size",) if "world_size" in cfg else ()),
                note="" if "world_size" in cfg else "$WORLD_SIZE")
    fsdp_cfg = cfg.get("fsdp_config") or {}
    on = fsdp_options(cfg.get("fsdp"), f"{where}: fsdp")
    if on or fsdp_cfg:
        if cfg.get("deepspeed"):  # validation.py check_fsdp_deepspeed
            raise SpecError(f"{where}: deepspeed", cfg["deepspeed"],
                            reason="deepspeed and fsdp cannot be used together")
        parallel = on or {"strategy": "fsdp"}
        for key, value in parallel.items():
            out.set(key, value, *(("fsdp",) if on else ("fsdp_config",)))
        par, spec, sources = fsdp_config.read(dict(fsdp_cfg), where, f"{where}: fsdp_config",
                                              SOURCE)
        out.merge({"parallel": par, "spec": spec, "sources": sources})
        return None, None
    ds = cfg.get("deepspeed")
    if not ds:
        return None, None
    ds = local_file(ds, folder)
    if isinstance(ds, dict):
        return ds, f"{where}: deepspeed"
    return read_json_object(ds, f"{where}: deepspeed"), str(ds)


# schemas/enums.py RLType -> the objective priced; IPO is DPO's step with another loss, SimPO
# (TRL's CPOTrainer) ORPO's: concatenated, no reference, an NLL term
RL_OBJECTIVES: dict[str, str] = {"dpo": "dpo", "ipo": "dpo", "orpo": "orpo", "kto": "kto",
                                 "simpo": "orpo", "grpo": "grpo"}


def _objective(cfg: dict, out: Layer, where: str) -> None:
    """`rl` (core/builders/rl.py: TRL's DPO / ORPO / KTO / CPO / GRPO trainers with their
    configs): beta from `trl.beta`, else `rl_beta` (`dpo_beta` its old name); the reference as
    TRL decides it (loaders: a frozen copy for a full run, none with an adapter: TRL disables
    it); `precompute_ref_log_probs`; GRPO's `trl:` block: `num_generations`,
    `max_completion_length` (the end of each `sequence_len` sequence), `use_vllm` with
    `vllm_mode: colocate` and `vllm_gpu_memory_utilization` (schemas/trl.py; TRL's 0.3 when
    unset)."""
    rl = cfg.get("rl")
    if rl is None:
        return
    rl = str(getattr(rl, "value", rl)).lower()
    if rl not in RL_OBJECTIVES:
        raise SpecError(f"{where}: rl", rl, list(RL_OBJECTIVES),
                        reason="this RL method is not priced")
    objective = RL_OBJECTIVES[rl]
    out.set("objective", objective, "rl")
    if rl == "simpo":
        config_keys.warn(f"{where}: axolotl rl 'simpo' is priced as ORPO's step (no reference, "
                         "chosen + rejected concatenated, an NLL term)")
    trl = cfg.get("trl") or {}
    if not isinstance(trl, dict):
        raise SpecError(f"{where}: trl", trl, reason="must be a mapping")
    for key, value in (("trl.beta", trl.get("beta")), ("rl_beta", cfg.get("rl_beta")),
                       ("dpo_beta", cfg.get("dpo_beta"))):
        if value is not None:
            out.set("beta", typed_value(f"{where}: {key}", schema.BY_KEY["beta"], value), key)
            break
    plugin = objectives.REGISTRY[objective]
    if cfg.get("precompute_ref_log_probs") and plugin.PRECOMPUTED_COLUMNS:  # DPO's, KTO's
        out.set("ref_model", "precomputed", "precompute_ref_log_probs")
    if not plugin.GENERATES:  # the rest is GRPO's generation
        return
    if trl.get("num_generations") is not None:
        out.set("num_generations", typed_value(f"{where}: trl.num_generations",
                                               schema.BY_KEY["num_generations"],
                                               trl["num_generations"]), "trl.num_generations")
    if trl.get("max_completion_length") is not None:
        out.set("max_completion_length", typed_value(
            f"{where}: trl.max_completion_length", schema.BY_KEY["max_completion_length"],
            trl["max_completion_length"]), "trl.max_completion_length")
    if flag(f"{where}: trl.use_vllm", trl.get("use_vllm", False)) \
            and trl.get("vllm_mode") == "colocate":
        frac = trl.get("vllm_gpu_memory_utilization")
        out.set("vllm_gpu_memory_utilization", float(0.3 if frac is None else frac),
                "trl.use_vllm", "trl.vllm_mode",
                *(("trl.vllm_gpu_memory_utilization",) if frac is not None else ()))
