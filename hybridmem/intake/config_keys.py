"""Every key of a config file a user gives is used, known-and-irrelevant, or a warning.

The config readers (`hybridmem.intake.readers`: TrainingArguments, DeepSpeed, PEFT's adapter
config, BitsAndBytesConfig) read the keys the job schema declares (`hybridmem.job.schema.config_keys`) and the keys their
own conversions declare. Any other key is checked against what the file's own library accepts
(TrainingArguments' fields, TRL SFTConfig's, LLaVA's extensions, DeepSpeed's config keys,
BitsAndBytesConfig's, the PEFT method's config fields): a known key changes no memory and is
ignored; an unknown one is a warning that names it, the file and the nearest known key
(difflib), since Trainer / DeepSpeed would refuse or drop it and the job would not be the one
the user meant. Warnings go to `collect_warnings()` when a caller collects them (the CLI prints
them and shows them in `--json`), else through Python's `warnings`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar

from hybridmem.intake import library_fields


class ConfigKeyWarning(UserWarning):
    """A config file key that hybridmem does not read and the file's library does not know."""


_COLLECTOR: ContextVar[list | None] = ContextVar("config_key_warnings", default=None)


@contextlib.contextmanager
def collect_warnings() -> Iterator[list[str]]:
    """Collect the readers' warnings (as one-line strings) instead of emitting them."""
    bucket: list[str] = []
    token = _COLLECTOR.set(bucket)
    try:
        yield bucket
    finally:
        _COLLECTOR.reset(token)


def warn(message: str) -> None:
    """One reader warning: to the collector if there is one, else `warnings.warn`."""
    bucket = _COLLECTOR.get()
    if bucket is not None:
        if message not in bucket:
            bucket.append(message)
    else:
        warnings.warn(message, ConfigKeyWarning, stacklevel=3)


LABELS: dict[str, str] = {"training_args": "TrainingArguments", "deepspeed": "DeepSpeed",
                          "peft": "PEFT adapter config", "bnb": "BitsAndBytesConfig",
                          "llamafactory": "LLaMA-Factory", "axolotl": "axolotl",
                          "torchtune": "torchtune", "accelerate": "accelerate",
                          "torchtitan": "torchtitan", "megatron": "Megatron-LM"}


def check_keys(source: str, data: dict, where: str, *, used: Iterable[str],
               known: Callable[[], Iterable[str]], prefix: str = "") -> None:
    """Warn about each key of `data` that is neither `used` nor `known()` (called only when a
    key is not used: it may import the file's library); `prefix` names the block the keys sit
    in, e.g. "zero_optimization."."""
    used = set(used)
    rest = [key for key in data if key not in used]
    if not rest:
        return
    known_keys = set(known())
    for key in rest:
        if key in known_keys:
            continue
        near = difflib.get_close_matches(key, sorted(used | known_keys), n=1)
        hint = f"; nearest known key: {prefix}{near[0]!s}" if near else ""
        warn(f"{where}: {LABELS[source]} key '{prefix}{key}' is unknown and was ignored{hint}")


def unpriced(source: str, data: dict, where: str, advice: dict[str, tuple[object, str]]) -> None:
    """Warn about known keys that change memory but are not read: `advice` maps a key to
    (the value that changes nothing, what to give instead)."""
    for key, (neutral, instead) in advice.items():
        if key in data and data[key] != neutral:
            warn(f"{where}: {LABELS[source]} key '{key}'={data[key]!r} is not priced; {instead}")


# ---------------------------------------------------------------- TrainingArguments

# TRL SFTConfig's own fields (trl/trainer/sft_config.py, TRL 0.2x-1.x, incl. names older
# releases used: max_seq_length, dataset_batch_size, num_of_sequences, chars_per_token,
# use_liger): known whatever TRL is installed (a file written for an older TRL names them),
# the whole set when trl is not installed
TRL_SFT_KEYS: frozenset[str] = frozenset({
    "model_init_kwargs", "chat_template_path", "dataset_text_field", "dataset_kwargs",
    "dataset_num_proc", "eos_token", "pad_token", "max_length", "max_seq_length",
    "truncation_mode", "shuffle_dataset", "packing", "packing_strategy", "padding_free",
    "pad_to_multiple_of", "eval_packing", "completion_only_loss", "assistant_only_loss",
    "loss_type", "activation_offloading", "dataset_batch_size", "num_of_sequences",
    "chars_per_token", "use_liger", "neftune_noise_alpha",
})
# LLaVA's TrainingArguments extensions (haotian-liu/LLaVA llava/train/train.py
# `TrainingArguments`) and the ModelArguments key its recipes pass the same way
LLAVA_KEYS: frozenset[str] = frozenset({
    "cache_dir", "freeze_mm_mlp_adapter", "mpt_attn_impl", "model_max_length", "double_quant",
    "quant_type", "bits", "lora_enable", "lora_r", "lora_alpha", "lora_dropout",
    "lora_weight_path", "lora_bias", "mm_projector_lr", "group_by_modality_length",
    "tune_mm_mlp_adapter",
})
# LLaVA's `bits` 4 / 8 loads the base with bitsandbytes (train.py builds a BitsAndBytesConfig
# from bits, quant_type and double_quant); not read from a TrainingArguments file
TRAINING_ARGS_UNPRICED: dict[str, tuple[object, str]] = {
    "bits": (16, "give --quantize nf4 / fp4 / int8 (LLaVA's bits quantises the base)"),
}


# TrainingArguments fields of transformers 4.x releases that 5.x dropped or renamed (e.g.
# `group_by_length` -> `train_sampling_strategy`, training_args.py): the launchers pin 4.x
# transformers (LLaMA-Factory's requirements, axolotl's), so their files carry them; known, and
# read where they price something (`group_by_length`: `intake.readers.trainer`)
TRANSFORMERS_4_FIELDS: frozenset[str] = frozenset({
    "adafactor", "dispatch_batches", "evaluation_strategy", "fp16_backend", "fp16_opt_level",
    "fsdp_min_num_params", "fsdp_transformer_layer_cls_to_wrap", "group_by_length",
    "half_precision_backend", "include_inputs_for_metrics", "include_tokens_per_second",
    "jit_mode_eval", "logging_dir", "mp_parameters", "no_cuda", "overwrite_output_dir",
    "past_index", "per_gpu_eval_batch_size", "per_gpu_train_batch_size",
    "push_to_hub_model_id", "push_to_hub_organization", "push_to_hub_token", "ray_scope",
    "save_safetensors", "split_batches", "torchdynamo", "tp_size", "tpu_metrics_debug",
    "tpu_num_cores", "use_ipex", "use_legacy_prediction_loop", "use_mps_device",
    "warmup_ratio",
})
# The other fields of TRL's DPOConfig, ORPOConfig, KTOConfig, RewardConfig and GRPOConfig
# (trl/trainer/*_config.py, TRL 0.1x-0.2x) that change no memory the tiers price (the ones
# that do are the objective fields' keys, `hybridmem.objectives.rules`)
TRL_OBJECTIVE_KEYS: frozenset[str] = frozenset({
    "ref_model_init_kwargs", "model_adapter_name", "ref_adapter_name", "force_use_ref_model",
    "disable_dropout", "use_logits_to_keep", "padding_value", "label_pad_token_id",
    "truncation_mode", "precompute_ref_batch_size", "tools", "use_liger_loss",
    "base_model_attribute_name", "f_divergence_type", "f_alpha_divergence_coef",
    "reference_free", "label_smoothing", "use_weighting", "ld_alpha", "discopop_tau",
    "loss_weights", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
    "generate_during_eval", "is_encoder_decoder", "model_init_kwargs", "pad_token",
    "eos_token", "chat_template_path", "num_generations_eval", "ds3_gather_for_generation",
    "shuffle_dataset", "pad_to_multiple_of", "generation_batch_size", "steps_per_generation",
    "temperature", "top_p", "top_k", "min_p", "generation_kwargs", "chat_template_kwargs",
    "repetition_penalty", "use_transformers_paged", "cache_implementation", "vllm_model_impl",
    "vllm_structured_outputs_regex", "vllm_server_base_url", "vllm_server_host",
    "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_max_model_length",
    "vllm_tensor_parallel_size", "vllm_enable_sleep_mode", "num_iterations", "epsilon",
    "delta", "epsilon_high", "importance_sampling_level", "reward_weights", "scale_rewards",
    "mask_truncated_completions", "top_entropy_quantile", "vllm_importance_sampling_correction",
    "vllm_importance_sampling_cap", "log_completions", "num_completions_to_print",
    "wandb_log_unique_prompts", "cast_lm_head_to_fp32", "dataset_num_proc",
    # and the ones the objective fields read
    "num_generations", "desirable_weight", "undesirable_weight", "center_rewards_coefficient",
    "rpo_alpha", "loss_type", "beta", "precompute_ref_log_probs", "max_prompt_length",
    "max_completion_length", "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization",
})
# where the installed libraries define the config classes read below (their source is read
# by `library_fields`, so that classifying keys imports neither transformers nor torch)
TRAINING_ARGS = ("transformers.training_args", "TrainingArguments")
SFT_CONFIG = ("trl.trainer.sft_config", "SFTConfig")


def training_args_known() -> frozenset[str]:
    """Field names of the installed `transformers.TrainingArguments`, TRL `SFTConfig` (the
    installed one, with `TRL_SFT_KEYS`' older names), LLaVA's extensions, the 4.x fields 5.x replaced and
    TRL's preference / RL configs' fields."""
    extra = LLAVA_KEYS | TRANSFORMERS_4_FIELDS | TRL_OBJECTIVE_KEYS
    names = set(library_fields.class_fields(*TRAINING_ARGS) or ())
    if not names:  # a source this reader cannot follow: ask the class itself
        from transformers import TrainingArguments

        names = {f.name for f in dataclasses.fields(TrainingArguments)}
    if not library_fields.installed("trl"):  # trl is optional
        return frozenset(names | TRL_SFT_KEYS | extra)
    # trl/trainer/sft_config.py imports TrainingArguments from transformers' lazy __init__
    sft = library_fields.class_fields(*SFT_CONFIG, hints={"TrainingArguments": TRAINING_ARGS})
    if sft is None:
        try:
            from trl import SFTConfig

            sft = frozenset(f.name for f in dataclasses.fields(SFTConfig))
        except ImportError:
            sft = TRL_SFT_KEYS
    return frozenset(names | sft | TRL_SFT_KEYS | extra)


# ---------------------------------------------------------------- DeepSpeed

# Top-level keys of a DeepSpeed config (deepspeed/runtime/constants.py and the sections
# deepspeed/runtime/config.py reads); deepspeed itself need not be installed to predict
DEEPSPEED_KEYS: frozenset[str] = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "amp", "torch_autocast",
    "gradient_clipping", "prescale_gradients", "gradient_predivide_factor", "sparse_gradients",
    "communication_data_type", "seq_parallel_comm_data_type", "zero_optimization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "steps_per_print",
    "wall_clock_breakdown", "memory_breakdown", "dump_state", "vocabulary_size",
    "disable_allgather", "graph_harvesting", "flops_profiler", "activation_checkpointing",
    "sparse_attention", "eigenvalue", "progressive_layer_drop", "checkpoint", "data_types",
    "dataloader_drop_last", "aio", "tensorboard", "wandb", "csv_monitor", "comet",
    "elasticity", "autotuning", "comms_logger", "compression_training", "data_efficiency",
    "curriculum_learning", "pipeline", "quantize_training", "weight_quantization",
    "hybrid_engine", "nebula", "compile", "timers", "tensor_parallel",
    "use_data_before_expert_parallelism", "use_node_local_storage",
})
# DeepSpeedZeroConfig fields and aliases (deepspeed/runtime/zero/config.py)
ZERO_KEYS: frozenset[str] = frozenset({
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
    "use_multi_rank_bucket_allreduce", "allgather_partitions", "allgather_bucket_size",
    "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint", "offload_param",
    "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "cpu_offload", "stage3_prefetch_bucket_size",
    "prefetch_bucket_size", "stage3_param_persistence_threshold", "param_persistence_threshold",
    "stage3_model_persistence_threshold", "model_persistence_threshold",
    "stage3_max_live_parameters", "max_live_parameters", "stage3_max_reuse_distance",
    "max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "stage3_module_granularity_threshold",
    "module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
    "use_all_reduce_for_fetch_params", "stage3_allgather_sequential", "allgather_sequential",
    "stage3_partition_stream_chunk_size", "partition_stream_chunk_size",
    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1",
    "round_robin_gradients", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zeropp_loco_param",
    "mics_shard_size", "mics_hierarchical_params_gather", "memory_efficient_linear",
    "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
    "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module",
})
# deprecated DeepSpeedZeroConfig switches with a memory effect (config.py: `cpu_offload` ->
# offload_optimizer cpu, `cpu_offload_param` -> offload_param cpu)
ZERO_UNPRICED: dict[str, tuple[object, str]] = {
    "cpu_offload": (False, 'write "offload_optimizer": {"device": "cpu"} (DeepSpeed\'s name '
                    "for it now)"),
    "cpu_offload_param": (False, 'write "offload_param": {"device": "cpu"}'),
}


# ---------------------------------------------------------------- BitsAndBytesConfig, PEFT

def bnb_known() -> frozenset[str]:
    """Keys of transformers' `BitsAndBytesConfig.to_dict()` (both load_in spellings)."""
    from transformers import BitsAndBytesConfig

    return frozenset(BitsAndBytesConfig(load_in_4bit=True).to_dict())


def peft_known(peft_type: str) -> frozenset[str] | None:
    """Field names of PEFT's config class for `peft_type` (None: peft or the type unknown)."""
    if not library_fields.installed("peft"):
        return None
    where = library_fields.peft_config_class(peft_type)
    names = library_fields.class_fields(*where) if where is not None else None
    if names is not None:
        return names
    try:  # a source this reader cannot follow: ask peft itself
        from peft import PEFT_TYPE_TO_CONFIG_MAPPING
    except ImportError:
        return None
    cls = PEFT_TYPE_TO_CONFIG_MAPPING.get(str(peft_type).upper())
    return None if cls is None else frozenset(f.name for f in dataclasses.fields(cls))
