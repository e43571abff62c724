"""LLaMA-Factory's training YAML (`llamafactory-cli train FILE`), read as LLaMA-Factory reads it.

LLaMA-Factory parses the file with HfArgumentParser into its ModelArguments, DataArguments,
TrainingArguments (transformers' Seq2SeqTrainingArguments plus Ray's), FinetuningArguments and
GeneratingArguments (src/llamafactory/hparams/parser.py `_parse_train_args`); a key none of them
declares stops the run there. So the file's Seq2SeqTrainingArguments keys are read by the
TrainingArguments reader (`readers.trainer.from_training_args`: batch, accumulation,
optim, clipping, DeepSpeed, FSDP), and LLaMA-Factory's own keys below, each with its default from
src/llamafactory/hparams/*.py and its effect from src/llamafactory/model/*.py (cited beside it).

Precision (parser.py: `compute_dtype` = bf16 if `bf16` or `pure_bf16`, fp16 if `fp16`, else
`infer_optim_dtype(config.torch_dtype)`: bf16 for a bf16 checkpoint on a bf16 GPU, else fp16;
model/patcher.py loads the model in it; model/adapter.py `init_adapter` then upcasts the
trainable parameters to fp32 unless `pure_bf16`):
- LoRA / QLoRA with `bf16`: the frozen base loaded in bf16, adapters fp32, and `bf16` is also
  the Trainer's own field (LLaMA-Factory's TrainingArguments subclass Seq2SeqTrainingArguments),
  so Trainer runs the step under bf16 autocast = `bf16-autocast`. With `fp16` (fp16 autocast
  over fp16 weights, not priced) = `fp16`; with neither, the checkpoint's inferred dtype and
  no autocast = `bf16` (`fp16`).
- full: fp32 trainable weights under Trainer's autocast = `bf16-mixed` (`fp16-mixed`), or
  `fp32` without `bf16` / `fp16`; `pure_bf16`: everything bf16 = `bf16`.
"""

from __future__ import annotations

from pathlib import Path

from hybridmem.errors import SpecError
from hybridmem.intake import config_keys
from hybridmem.intake.readers.common import typed_value
from hybridmem.intake.readers.trainer import HF_DEFAULT_BATCH, from_training_args
from hybridmem.intake.dialects.common import (
    Layer,
    LauncherConfig,
    flag,
    hf_training_fields,
    is_multimodal,
    local_file,
    model_of,
    names,
    torch_dtype_of,
)
from hybridmem.job import schema

NAME = "LLaMA-Factory"
SOURCE = "llamafactory"
DETECT_ORDER = 30  # after axolotl: LLaMA-Factory's method keys

READ: tuple[str, ...] = (
    "model_name_or_path", "stage", "finetuning_type", "lora_rank", "lora_alpha", "lora_dropout",
    "pref_beta", "pref_loss", "ref_model",
    "lora_target", "use_dora", "use_rslora", "additional_target", "quantization_bit",
    "quantization_method", "quantization_type", "double_quantization", "cutoff_len", "packing",
    "image_max_pixels", "image_min_pixels", "video_max_pixels", "video_min_pixels", "video_fps",
    "video_maxlen",
    "neat_packing", "pure_bf16", "flash_attn", "disable_gradient_checkpointing", "use_unsloth_gc",
    "enable_liger_kernel", "freeze_vision_tower", "freeze_multi_modal_projector",
    "freeze_language_model",
)
"""LLaMA-Factory's own keys this reader prices (the Seq2SeqTrainingArguments keys of the file
go to the TrainingArguments reader)."""

# The other fields of LLaMA-Factory's argument dataclasses (hparams/model_args.py,
# data_args.py, finetuning_args.py, generating_args.py, training_args.py RayArguments),
# including names of earlier releases: known, no memory effect (or warned below when they have
# one that is not priced).
KNOWN: frozenset[str] = frozenset({
    # model_args.py BaseModelArguments / QuantizationArguments / ProcessorArguments / Export /
    # vLLM / SGLang / KTransformers
    "adapter_name_or_path", "adapter_folder", "cache_dir", "use_fast_tokenizer", "resize_vocab",
    "split_special_tokens", "add_tokens", "add_special_tokens", "new_special_tokens",
    "new_special_tokens_config", "init_special_tokens", "model_revision", "low_cpu_mem_usage",
    "rope_scaling", "shift_attn", "mixture_of_depths", "use_unsloth", "moe_aux_loss_coef",
    "use_reentrant_gc", "upcast_layernorm", "upcast_lmhead_output", "train_from_scratch",
    "infer_backend", "offload_folder", "use_kv_cache", "use_v1_kernels", "infer_dtype",
    "hf_hub_token", "ms_hub_token", "om_hub_token", "print_param_status", "trust_remote_code",
    "visual_inputs", "quantization_device_map", "fp8", "fp8_backend",
    "fp8_enable_fsdp_float8_all_gather", "image_max_pixels", "image_min_pixels",
    "image_resolution", "video_resolution", "image_do_pan_and_scan", "crop_to_patches",
    "video_max_pixels", "video_min_pixels", "video_fps", "video_maxlen", "use_audio_in_video",
    "audio_sampling_rate", "export_dir", "export_size", "export_device",
    "export_quantization_bit", "export_quantization_dataset", "export_quantization_nsamples",
    "export_quantization_maxlen", "export_legacy_format", "export_hub_model_id", "vllm_maxlen",
    "vllm_gpu_util", "vllm_enforce_eager", "vllm_max_lora_rank", "vllm_config",
    "sglang_maxlen", "sglang_mem_fraction", "sglang_tp_size", "sglang_config",
    "sglang_lora_backend", "use_kt", "kt_optimize_rule", "cpu_infer", "chunk_size", "mode",
    "kt_maxlen", "kt_use_cuda_graph", "kt_mode", "kt_force_think",
    # data_args.py DataArguments
    "template", "dataset", "eval_dataset", "dataset_dir", "media_dir", "train_on_prompt",
    "mask_history", "streaming", "buffer_size", "mix_strategy", "interleave_probs",
    "overwrite_cache", "preprocessing_batch_size", "preprocessing_num_workers", "max_samples",
    "eval_num_beams", "ignore_pad_token_for_loss", "val_size", "eval_on_each_dataset",
    "tool_format", "tokenized_path", "default_system", "enable_thinking",
    "data_shared_file_system",
    # finetuning_args.py Freeze / LoRA / OFT / RLHF / GaLore / APOLLO / BAdam / SwanLab
    "freeze_trainable_layers", "freeze_trainable_modules", "freeze_extra_modules",
    "loraplus_lr_ratio", "loraplus_lr_embedding", "pissa_init", "pissa_iter", "pissa_convert",
    "create_new_adapter", "module_dropout", "oft_rank", "oft_block_size", "oft_target",
    "pref_beta", "pref_ftx", "pref_bco_weight", "pref_loss", "dpo_label_smoothing",
    "kto_chosen_weight", "kto_rejected_weight", "simpo_gamma", "ppo_buffer_size", "ppo_epochs",
    "ppo_score_norm", "ppo_target", "ppo_whiten_rewards", "ref_model", "ref_model_adapters",
    "ref_model_quantization_bit", "reward_model", "reward_model_adapters",
    "reward_model_quantization_bit", "reward_model_type", "ld_alpha", "use_galore",
    "galore_target", "galore_rank", "galore_update_interval", "galore_scale",
    "galore_proj_type", "galore_layerwise", "use_apollo", "apollo_target", "apollo_rank",
    "apollo_update_interval", "apollo_scale", "apollo_proj", "apollo_proj_type",
    "apollo_scale_type", "apollo_layerwise", "apollo_scale_front", "use_badam", "badam_mode",
    "badam_start_block", "badam_switch_mode", "badam_switch_interval", "badam_update_ratio",
    "badam_mask_mode", "badam_verbose", "use_swanlab", "swanlab_project", "swanlab_workspace",
    "swanlab_run_name", "swanlab_mode", "swanlab_api_key", "swanlab_logdir",
    "swanlab_lark_webhook_url", "swanlab_lark_secret", "use_llama_pro", "use_adam_mini",
    "use_mca", "use_muon", "use_dft_loss", "compute_accuracy", "disable_shuffling",
    "early_stopping_steps", "plot_loss", "include_effective_tokens_per_second",
    # generating_args.py GeneratingArguments
    "do_sample", "temperature", "top_p", "top_k", "num_beams", "max_length", "max_new_tokens",
    "repetition_penalty", "length_penalty", "skip_special_tokens",
    # training_args.py RayArguments (+ its own overwrite_output_dir)
    "ray_run_name", "ray_storage_path", "ray_storage_filesystem", "ray_num_workers",
    "resources_per_worker", "placement_strategy", "ray_init_kwargs", "overwrite_output_dir",
})

# keys with a memory effect this reader does not price: (the value that changes nothing, advice)
UNPRICED: dict[str, tuple[object, str]] = {
    "use_unsloth": (False, "unsloth's own kernels are not priced"),
    "upcast_lmhead_output": (False, "fp32 logits (checkpointing.py _fp32_forward_post_hook) "
                             "are not priced"),
    "upcast_layernorm": (False, "fp32 norm weights are not priced (a few MiB)"),
    "use_galore": (False, "GaLore's projected optimizer state is not priced"),
    "use_apollo": (False, "APOLLO's optimizer state is not priced"),
    "use_badam": (False, "BAdam's block-wise optimizer is not priced"),
    "use_adam_mini": (False, "Adam-mini's optimizer state is not priced"),
    "use_muon": (False, "Muon's optimizer state is not priced"),
    "use_llama_pro": (False, "LLaMA Pro's expanded blocks are not priced"),
    "shift_attn": (False, "S^2-Attn is not priced"),
    "fp8": (False, "FP8 training is not priced"),
}

# flash_attn (model_args.py `AttentionFunction`, default "auto"; model_utils/attention.py
# `configure_attn_implementation`: auto leaves transformers' choice, off/disabled -> eager)
ATTN: dict[str, str | None] = {"auto": None, "disabled": "eager", "off": "eager",
                               "sdpa": "sdpa", "fa2": "flash_attention_2"}


def detect(cfg: dict) -> bool:
    """LLaMA-Factory's own method keys, or its model key with its cutoff length."""
    return "finetuning_type" in cfg or "stage" in cfg or (
        "model_name_or_path" in cfg and "cutoff_len" in cfg)


def _get(cfg: dict, key: str, default: object) -> tuple[object, tuple[str, ...]]:
    """(value, (key,)) when the file gives it, else (the launcher's default, ())."""
    return (cfg[key], (key,)) if cfg.get(key) is not None else (default, ())


def read(raw: dict, where: str, folder: Path, model: str | None = None) -> LauncherConfig:
    """The file's layer; `folder` is where the file sits (a relative DeepSpeed path)."""
    hf_fields = hf_training_fields()
    config_keys.check_keys(SOURCE, raw, where,
                           used={*READ, *((hf_fields | {"group_by_length"}) & set(raw))},
                           known=lambda: KNOWN | hf_fields | config_keys.TRANSFORMERS_4_FIELDS)
    cfg = {k: v for k, v in raw.items() if v is not None}
    config_keys.unpriced(SOURCE, cfg, where, UNPRICED)
    model, hub_id = model_of(raw.get("model_name_or_path"), where, "model_name_or_path", override=model)
    out = Layer(where, NAME)
    out.set("model", model, "model_name_or_path", note=hub_id)

    # the file's Seq2SeqTrainingArguments, as Trainer reads them
    args = {k: v for k, v in cfg.items() if k in hf_fields or k == "group_by_length"}
    if "deepspeed" in args:
        args["deepspeed"] = local_file(args["deepspeed"], folder)
    ta = from_training_args(args, where=where)
    out.merge(ta)
    if "per_device_train_batch_size" not in args:  # TrainingArguments' default
        out.set("micro_batch", HF_DEFAULT_BATCH)

    stage, keys = _get(cfg, "stage", "sft")  # finetuning_args.py: default "sft"
    if stage not in ("sft", "pt", "dpo", "kto"):
        raise SpecError(f"{where}: stage", stage, ["sft", "pt", "dpo", "kto"],
                        reason="LLaMA-Factory's rm and ppo stages run trl's "
                        "AutoModelForCausalLMWithValueHead (vocabulary logits and a value head; "
                        "ppo also generates beside a reward model), not priced; TRL's "
                        "RewardTrainer is (--objective rm)")
    method, method_keys = _get(cfg, "finetuning_type", "lora")  # finetuning_args.py: "lora"
    if method not in ("lora", "full"):
        raise SpecError(f"{where}: finetuning_type", method, ["lora", "full"],
                        reason="freeze (the last N layers) and oft are not priced")
    vlm = is_multimodal(model)
    if method == "lora":
        out.set("train", "lora", *method_keys)
        _lora(cfg, out, where, vlm)
    else:
        freeze = [k for k in ("freeze_vision_tower", "freeze_multi_modal_projector",
                              "freeze_language_model") if vlm and k in cfg]
        out.set("train", _full_train(cfg, where, vlm), *method_keys, *freeze)
    _precision(cfg, out, model, method)
    _quantization(cfg, out, where, method)
    _objective(cfg, out, where, stage, method)
    _batch(cfg, out, where, stage)
    _images(cfg, out, where, model, vlm)
    _savers(cfg, out, where)
    hf = dict(ta["hf"])
    return LauncherConfig(NAME, model, [out.data], hf, ta["deepspeed"], ta["deepspeed_where"])


def _objective(cfg: dict, out: Layer, where: str, stage: str, method: str) -> None:
    """`stage: dpo | kto` (train/dpo, train/kto: CustomDPOTrainer / CustomKTOTrainer, TRL's
    trainers with LLaMA-Factory's loss): finetuning_args.py RLHFArguments `pref_beta` 0.1,
    `pref_loss` "sigmoid" (`orpo` / `simpo`: no reference, `use_ref_model` is off), `ref_model`
    None; train/trainer_utils.py `create_ref_model`: a given `ref_model` is loaded beside,
    LoRA without one uses the policy with its adapters disabled, a full run loads a frozen
    copy (`is_trainable=False`: the compute dtype)."""
    if stage not in ("dpo", "kto"):
        return
    loss, loss_keys = _get(cfg, "pref_loss", "sigmoid")
    free = stage == "dpo" and loss in ("orpo", "simpo")
    out.set("objective", "orpo" if free else stage, "stage", *(loss_keys if free else ()))
    if loss == "simpo" and stage == "dpo":
        config_keys.warn(f"{where}: LLaMA-Factory pref_loss 'simpo' is priced as ORPO's step "
                         "(no reference, chosen + rejected concatenated, an NLL term)")
    beta, beta_keys = _get(cfg, "pref_beta", 0.1)
    out.set("beta", typed_value(f"{where}: pref_beta", schema.BY_KEY["beta"], beta),
            *beta_keys)
    if free:
        return
    if cfg.get("ref_model") is not None:
        out.set("ref_model", "separate", "ref_model")
    elif method == "lora":
        out.set("ref_model", "adapter")
    else:
        out.set("ref_model", "separate")
        if out.data["spec"].get("precision") in ("bf16-mixed", "fp16-mixed"):
            config_keys.warn(f"{where}: LLaMA-Factory loads the full run's reference in the "
                             "compute dtype; it is priced as a copy of the fp32 policy (TRL's "
                             "create_reference_model), twice its bytes")


def _lora(cfg: dict, out: Layer, where: str, vlm: bool) -> None:
    """finetuning_args.py LoraArguments: lora_rank 8, lora_alpha None -> rank * 2, dropout 0,
    lora_target "all"; adapter.py `_setup_lora_tuning`: "all" = `find_all_linear_modules`
    (model_utils/misc.py: every linear but lm_head, the projector, and the vision tower while
    `freeze_vision_tower`) = the LLM's linears, our default targets."""
    rank, keys = _get(cfg, "lora_rank", 8)
    out.set("lora_r", typed_value(f"{where}: lora_rank", schema.BY_KEY["lora_r"], rank), *keys)
    if cfg.get("lora_alpha") is not None:
        out.set("lora_alpha", typed_value(f"{where}: lora_alpha", schema.BY_KEY["lora_alpha"],
                                          cfg["lora_alpha"]), "lora_alpha")
    else:
        out.set("lora_alpha", float(rank * 2), note="lora_rank * 2")
    if cfg.get("lora_dropout"):
        out.set("lora_dropout", typed_value(f"{where}: lora_dropout",
                                            schema.BY_KEY["lora_dropout"], cfg["lora_dropout"]),
                "lora_dropout")
    target = names(cfg.get("lora_target", "all"), f"{where}: lora_target")
    if target != ("all",):
        out.set("lora_targets", target, "lora_target")
    elif vlm and not flag(f"{where}: freeze_vision_tower", cfg.get("freeze_vision_tower", True)):
        config_keys.warn(f"{where}: LLaMA-Factory key 'freeze_vision_tower'=False with "
                         "lora_target all also adapts the vision tower's linears, which are not "
                         "priced; give --lora-targets")
    for key, field in (("use_dora", "lora_use_dora"), ("use_rslora", "lora_use_rslora")):
        if cfg.get(key) is not None:
            out.set(field, flag(f"{where}: {key}", cfg[key]), key)
    if cfg.get("additional_target"):  # adapter.py: LoraConfig(modules_to_save=...)
        out.set("lora_modules_to_save", names(cfg["additional_target"],
                                              f"{where}: additional_target"), "additional_target")


def _full_train(cfg: dict, where: str, vlm: bool) -> str:
    """adapter.py `_setup_full_tuning` freezes `get_forbidden_modules` (model_utils/visual.py):
    the vision tower while `freeze_vision_tower` (default True), the projector while
    `freeze_multi_modal_projector` (default True), the LLM while `freeze_language_model`
    (default False). Priced: the LLM alone as llm, the LLM and projector as llm+projector,
    everything as full, the projector alone as projector; a frozen projector under a trained
    tower is priced trainable (a few M params), with a warning."""
    if not vlm:
        return "full"
    tower = flag(f"{where}: freeze_vision_tower", cfg.get("freeze_vision_tower", True))
    projector = flag(f"{where}: freeze_multi_modal_projector",
                     cfg.get("freeze_multi_modal_projector", True))
    language = flag(f"{where}: freeze_language_model", cfg.get("freeze_language_model", False))
    if not language:
        if tower:
            return "llm" if projector else "llm+projector"
        if projector:
            config_keys.warn(f"{where}: LLaMA-Factory key 'freeze_multi_modal_projector'=True "
                             "with the vision tower trained: the projector is priced trainable")
        return "full"
    if tower and not projector:
        return "projector"
    raise SpecError(f"{where}: freeze_language_model", True, [False], reason="with this "
                    "vision tower / projector freezing nothing priced here trains")


def _precision(cfg: dict, out: Layer, model: str, method: str) -> None:
    """Module docstring, "Precision"."""
    where = out.where
    bf16 = flag(f"{where}: bf16", cfg.get("bf16", False))
    fp16 = flag(f"{where}: fp16", cfg.get("fp16", False))
    pure = flag(f"{where}: pure_bf16", cfg.get("pure_bf16", False))
    if pure:
        out.set("precision", "bf16", "pure_bf16")
        return
    if method == "full":
        keys = ("bf16",) if bf16 else ("fp16",) if fp16 else ()
        out.set("precision", "bf16-mixed" if bf16 else "fp16-mixed" if fp16 else "fp32", *keys)
        return
    if bf16 or fp16:
        out.set("precision", "bf16-autocast" if bf16 else "fp16", "bf16" if bf16 else "fp16")
        return
    # misc.py infer_optim_dtype: bf16 for a bf16 checkpoint (the GPU catalogue's support it)
    dtype = torch_dtype_of(model)
    out.set("precision", "bf16" if dtype == "bfloat16" else "fp16",
            note=f"the model's torch_dtype {dtype}")


def _quantization(cfg: dict, out: Layer, where: str, method: str) -> None:
    """model_utils/quantization.py `configure_quantization` (bitsandbytes, on the fly): 8 bits
    -> BitsAndBytesConfig(load_in_8bit=True); 4 bits -> load_in_4bit with compute and storage
    dtype = the compute dtype, `double_quantization` (default True), `quantization_type`
    (default nf4). LLaMA-Factory never calls peft's prepare_model_for_kbit_training (its own
    `prepare_model_for_training`, model_utils/checkpointing.py, upcasts nothing by default)."""
    if cfg.get("quantization_bit") is None:
        return
    from hybridmem.techniques.quantize import from_bnb_config

    bits = cfg["quantization_bit"]
    if method != "lora":  # parser.py _verify_model_args
        raise SpecError(f"{where}: quantization_bit", bits, reason="LLaMA-Factory quantises "
                        "only for LoRA (finetuning_type: lora)")
    qmethod = str(cfg.get("quantization_method", "bnb"))
    if qmethod not in ("bnb", "bitsandbytes"):
        raise SpecError(f"{where}: quantization_method", qmethod, ["bnb"],
                        reason="only bitsandbytes quantisation is priced")
    precision = out.data["spec"]["precision"]
    compute = "float16" if precision == "fp16" else "bfloat16"
    if bits == 8:
        bnb = {"load_in_8bit": True}
    elif bits == 4:
        bnb = {"load_in_4bit": True, "bnb_4bit_compute_dtype": compute,
               "bnb_4bit_quant_storage": compute,
               "bnb_4bit_use_double_quant": flag(f"{where}: double_quantization",
                                                 cfg.get("double_quantization", True)),
               "bnb_4bit_quant_type": cfg.get("quantization_type", "nf4")}
    else:
        raise SpecError(f"{where}: quantization_bit", bits, [4, 8],
                        reason="bitsandbytes quantises to 4 or 8 bits")
    keys = [k for k in ("quantization_bit", "quantization_type", "double_quantization")
            if k in cfg]
    for key, value in from_bnb_config(bnb, f"{where}: quantization").items():
        out.set(key, value, *keys)
    out.set("kbit_prep", False)


def _batch(cfg: dict, out: Layer, where: str, stage: str) -> None:
    """data_args.py: cutoff_len 2048; `packing` None -> on for stage pt; `neat_packing` turns
    packing on; with packing `cutoff_len -= 1`. LLaMA-Factory packs samples into rows of
    cutoff_len tokens (data/processor/supervised.py), the same tokens per row as the padded
    batch priced here; neat_packing's block-diagonal mask is not priced."""
    length, keys = _get(cfg, "cutoff_len", 2048)
    length = typed_value(f"{where}: cutoff_len", schema.BY_KEY["seq_len"], length)
    neat = flag(f"{where}: neat_packing", cfg.get("neat_packing", False))
    packing = True if neat else flag(f"{where}: packing", cfg.get("packing", stage == "pt"))
    if neat:
        config_keys.warn(f"{where}: LLaMA-Factory key 'neat_packing'=True is priced as plain "
                         "packing; its block-diagonal attention mask is not priced")
    if packing:
        out.set("seq_len", length - 1, *keys, note="cutoff_len - 1 with packing")
    else:
        out.set("seq_len", length, *keys)


# model_args.py ProcessorArguments: image_max_pixels 768 * 768, image_min_pixels 32 * 32,
# video_max_pixels 256 * 256, video_min_pixels 16 * 16, video_fps 2.0, video_maxlen 128
VIDEO_KEYS: tuple[str, ...] = ("video_max_pixels", "video_min_pixels", "video_fps",
                               "video_maxlen")


def _pixels(cfg: dict, key: str, default: int, where: str) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{where}: {key}", value, reason="must be a positive number of pixels")
    return value


def _images(cfg: dict, out: Layer, where: str, model: str, vlm: bool) -> None:
    """data/mm_plugin.py `_preprocess_image`: an image above `image_max_pixels` is scaled down
    to it (both sides by sqrt(max / (w h))), one below `image_min_pixels` up to it, before the
    model's own processor sees it. Where that processor keeps the size it gets (native
    resolution, image splitting: `image_size` may be HxW) the largest square image LLaMA-Factory
    keeps is priced (Qwen3-VL at 262144 pixels: 512x512, 16 x 16 merged patches = 256 tokens);
    a processor that resizes every image to its tower's side makes the keys change nothing.
    Videos are not priced (the batches carry images), so the video keys are warned."""
    import math

    for key in VIDEO_KEYS:
        if key in cfg:
            config_keys.warn(f"{where}: LLaMA-Factory key '{key}'={cfg[key]!r} is not priced; "
                             "video samples are not priced (images are)")
    keys = [k for k in ("image_max_pixels", "image_min_pixels") if k in cfg]
    if not keys or not vlm:
        return
    from hybridmem.families.common.images import HXW_FAMILIES
    from hybridmem.models.loader import model_type_of

    mt = model_type_of(model)
    if mt not in HXW_FAMILIES:
        config_keys.warn(f"{where}: LLaMA-Factory keys {'/'.join(keys)} change nothing for "
                         f"{mt}: its processor resizes every image to the tower's side")
        return
    hi, lo = (_pixels(cfg, key, default, where) for key, default in
              (("image_max_pixels", 768 * 768), ("image_min_pixels", 32 * 32)))
    side = max(math.isqrt(hi), math.isqrt(lo - 1) + 1 if lo > 1 else 1)
    out.set("image_size", f"{side}x{side}", *keys,
            note="the largest square image LLaMA-Factory keeps; give --image-size HxW for yours")


def _savers(cfg: dict, out: Layer, where: str) -> None:
    """model_args.py: `disable_gradient_checkpointing` False (checkpointing.py
    `prepare_model_for_training` enables checkpointing unless it is set), `use_unsloth_gc`
    (unsloth's checkpointing: the checkpointed layers' inputs in host memory),
    `enable_liger_kernel` (model_utils/liger_kernel.py: Liger's default kernels),
    `flash_attn` (ATTN)."""
    off = flag(f"{where}: disable_gradient_checkpointing",
               cfg.get("disable_gradient_checkpointing", False))
    keys = ("disable_gradient_checkpointing",) if "disable_gradient_checkpointing" in cfg else ()
    out.set("grad_ckpt", not off, *keys)
    if not off and cfg.get("use_unsloth_gc") and flag(f"{where}: use_unsloth_gc",
                                                      cfg["use_unsloth_gc"]):
        out.set("offload_activations", "ckpt-inputs", "use_unsloth_gc")
    if cfg.get("enable_liger_kernel") is not None:
        out.set("liger", flag(f"{where}: enable_liger_kernel", cfg["enable_liger_kernel"]),
                "enable_liger_kernel")
    attn = str(cfg.get("flash_attn", "auto"))
    if attn not in ATTN:
        raise SpecError(f"{where}: flash_attn", attn, sorted(ATTN))
    if ATTN[attn] is not None:
        out.set("attn", ATTN[attn], "flash_attn")
