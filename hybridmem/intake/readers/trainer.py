"""Training configs users already have -> TrainingSpec keyword arguments.

Sources, in increasing priority: a recipe preset, HF `TrainingArguments` (JSON of its fields),
a DeepSpeed JSON, then explicit command-line values. "auto" DeepSpeed values are resolved the
way transformers does it (`integrations/deepspeed.py`, `HfTrainerDeepSpeedConfig`):
`trainer_config_process` fills batch size and bf16/fp16 from the TrainingArguments, and
`trainer_config_finalize` fills the hidden-size based keys from the model config.

Which key sets which field comes from the job schema (`hybridmem.job.schema.config_keys`):
a declared key is copied onto its field, the conversions below read the keys that need more and
declare them; any other key is known to the file's library or a warning
(`hybridmem.intake.config_keys`). Every problem is a one-line SpecError (malformed JSON, an
"auto" that cannot be resolved, contradictory options).

A launcher's own config file (`--config`: LLaMA-Factory, axolotl, torchtune YAML, read by
`hybridmem.intake.dialects`, which builds on the readers here; `hybridmem.intake.merge`
joins them) is one more layer, above a recipe and below the other files:
its launcher's defaults, then its keys. Each layer says where each field it sets came from
(`sources`: flat key -> "FILE: key", "flag --x", "launcher default (...)"), and
`resolve_inputs` returns those of the fields the job does not leave at the schema default.
HF Trainer's `TrainingArguments` (and TRL's trainer configs) are read here; the DeepSpeed JSON
it resolves from them in `readers.deepspeed`, the PEFT and BitsAndBytes files beside it
(`readers.peft`, `readers.bnb`), the helpers every reader shares in `readers.common`, which
TRL config names which trainer in `readers.trl`; the layers are joined in
`hybridmem.intake.merge`.
"""

from __future__ import annotations

import json
import os

from hybridmem.errors import SpecError
from hybridmem.job import schema
from hybridmem.job.optimizers import HF_DEFAULT_OPTIM, HF_OPTIMS, from_hf  # noqa: F401
from hybridmem.techniques.liger import check_liger_config
from hybridmem.intake import config_keys
from hybridmem.intake.readers import fsdp as fsdp_config
from hybridmem.intake.readers.common import (
    CONVERSIONS, attribute, clip_norm, converts, copy_declared, flag_value, key_where,
    layer_values, read_json, typed_value, used_keys, whole_count,
)
from hybridmem.intake.readers.trl import SFT_MARKERS, objective_of

# transformers `OptimizerNames` -> our optimizer names: the registry's (`job.optimizers`)
HF_DEFAULT_BATCH = 8  # TrainingArguments.per_device_train_batch_size default
# TrainingArguments defaults of the fields that resolve DeepSpeed "auto" values
HF_DEFAULTS: dict = {"per_device_train_batch_size": HF_DEFAULT_BATCH, "bf16": False,
                     "fp16": False, "gradient_accumulation_steps": 1}
# TrainingArguments `fsdp` options -> FSDP settings (FSDP1 names; SHARD_GRAD_OP keeps params
# unsharded between forward and backward = FSDP2 reshard_after_forward=False)
FSDP_OPTIONS: dict[str, dict] = {
    "full_shard": {"strategy": "fsdp", "reshard_after_forward": True},
    "shard_grad_op": {"strategy": "fsdp", "reshard_after_forward": False},
    "no_shard": {"strategy": "ddp"},
    "auto_wrap": {},
}
OPTION_FILES: tuple[str, ...] = ("peft_config", "quantization_config")
"""Overrides that name a file to read (the `--peft-config` / `--quantization-config` options),
not a job field's value."""
# TrainingArguments.max_grad_norm default (transformers training_args.py): Trainer clips at 1.0
HF_DEFAULT_MAX_GRAD_NORM = 1.0
TRAINER_DEFAULT = "launcher default (HF Trainer)"
"""The source of a field a TrainingArguments file sets without naming it (Trainer's default)."""


# ---------------------------------------------------------------- TrainingArguments

@converts("training_args", "activation_checkpointing", "gradient_checkpointing",
          "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
def _checkpointing(args: dict, out: dict) -> None:
    """`grad_ckpt` / `grad_ckpt_policy` from TrainingArguments' checkpointing fields.

    transformers 5.x: `activation_checkpointing` (+ `_kwargs`), with `gradient_checkpointing*`
    as deprecated aliases used only when the new name is unset (training_args.py
    `__post_init__`); Trainer pops `every_n_layers` (default 1) and `offload` from the kwargs and
    calls `activation_checkpointing_enable(every_n_layers=...)` (trainer.py)."""
    spec = out["spec"]
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if args.get(name) is not None:
            spec["grad_ckpt"] = flag_value(f"training_args.{name}", args[name])
            break
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        kwargs = args.get(name)
        if kwargs is None:
            continue
        if isinstance(kwargs, str):
            try:
                kwargs = json.loads(kwargs)
            except json.JSONDecodeError:
                raise SpecError(f"training_args.{name}", kwargs, reason="is not a JSON object") from None
        if not isinstance(kwargs, dict):
            raise SpecError(f"training_args.{name}", kwargs, reason="must be an object")
        if kwargs.get("offload") is not None:  # save_on_cpu around each checkpoint call
            if flag_value(f"training_args.{name}.offload", kwargs["offload"]) and spec.get("grad_ckpt"):
                spec["offload_activations"] = "ckpt-inputs"
        every = kwargs.get("every_n_layers", 1)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise SpecError(f"training_args.{name}.every_n_layers", every,
                            reason="must be a positive integer")
        if spec.get("grad_ckpt"):
            spec["grad_ckpt_policy"] = "full" if every == 1 else f"every:{every}"
        break


@converts("training_args", "activation_offloading")
def _offloading(args: dict, out: dict) -> None:
    """TRL SFTConfig `activation_offloading` (trl/trainer/sft_config.py): SFTTrainer wraps each
    training_step in get_act_offloading_ctx_manager(model) (hybridmem.techniques.offload "all"); it
    takes precedence over the checkpoint-inputs-only variant, whose inputs it offloads too."""
    if args.get("activation_offloading") is not None and flag_value(
            "training_args.activation_offloading", args["activation_offloading"]):
        out["spec"]["offload_activations"] = "all"


@converts("training_args", "padding_free", "packing")
def _packing(args: dict, out: dict) -> None:
    """TRL SFTConfig `padding_free` / `packing` (sft_trainer.py: packing, or padding_free, makes
    the collator `DataCollatorForLanguageModeling(padding_free=True)`; hybridmem.techniques.packing)."""
    for key in ("padding_free", "packing"):
        if args.get(key) is not None and flag_value(f"training_args.{key}", args[key]):
            out["spec"]["packing"] = True


@converts("training_args", "train_sampling_strategy", "group_by_length", "seed", "data_seed",
          "max_steps")
def _batching(args: dict, out: dict) -> None:
    """The sampler and run length (`hybridmem.job.batching`): `train_sampling_strategy` or
    `group_by_length`; the sampler's seed, `data_seed` over `seed`; `max_steps` (-1, Trainer's
    default, means epochs: our 0)."""
    from hybridmem.job.batching import sampler_from_hf

    sampler = sampler_from_hf(args.get("train_sampling_strategy"), args.get("group_by_length"))
    if sampler is not None:
        out["spec"]["sampler"] = sampler
    for key in ("seed", "data_seed"):  # data_seed, when given, seeds the sampler instead
        if args.get(key) is not None:
            out["spec"]["seed"] = whole_count(f"training_args.{key}", args[key])
    steps = args.get("max_steps")
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < -1:
            raise SpecError("training_args.max_steps", steps,
                            reason="must be -1 (epochs) or a non-negative integer")
        out["spec"]["max_steps"] = max(steps, 0)
# The TRL trainer a config JSON belongs to, told by a key only its config class has
# (trl/trainer/grpo_config.py, kto_config.py, reward_config.py, dpo_config.py); ORPOConfig
# has none of them but `beta` (orpo_config.py)
@converts("training_args", *SFT_MARKERS)
def _sft_trainer(args: dict, out: dict) -> None:
    """A TRL SFTConfig JSON (`SFT_MARKERS`) runs SFTTrainer's step: `trainer="trl"` (its
    fused head at TRL >= 1.15, `hybridmem.objectives.fused_head`)."""
    if any(key in args for key in SFT_MARKERS):
        out["spec"]["trainer"] = "trl"
        out.setdefault("sources", {})["trainer"] = (
            f"{out.get('where', 'training_args')}: "
            f"{next(k for k in SFT_MARKERS if k in args)}")


@converts("training_args", "num_generations", "use_vllm", "vllm_mode",
          "vllm_gpu_memory_utilization", "desirable_weight", "undesirable_weight",
          "center_rewards_coefficient", "rpo_alpha", "loss_type", "beta",
          "precompute_ref_log_probs", "max_prompt_length", "max_completion_length")
def _objective(args: dict, out: dict) -> None:
    """TRL's DPOConfig / ORPOConfig / KTOConfig / RewardConfig / GRPOConfig as JSON
    (`hybridmem.objectives`): the objective from the keys only its config has, `beta`,
    `precompute_ref_log_probs` (-> ref_model precomputed), GRPO's `num_generations`, its
    sequence `max_prompt_length + max_completion_length` (defaults 512 + 256 in the TRL
    releases that have max_prompt_length) and vLLM colocated (`use_vllm` and `vllm_mode`
    "colocate": `vllm_gpu_memory_utilization`, default 0.3; "server", TRL's default mode, runs
    vLLM on other GPUs)."""
    from hybridmem import objectives
    from hybridmem.objectives import grpo

    spec = out["spec"]
    objective = objective_of(args)
    if objective is None:
        return
    spec["objective"] = objective
    if args.get("beta") is not None:
        spec["beta"] = typed_value("training_args.beta", schema.BY_KEY["beta"], args["beta"])
    if args.get("precompute_ref_log_probs") is not None and flag_value(
            "training_args.precompute_ref_log_probs", args["precompute_ref_log_probs"]):
        spec["ref_model"] = "precomputed"
    for key in ("max_prompt_length", "max_completion_length"):
        if args.get(key) is not None:
            spec[key] = whole_count(f"training_args.{key}", args[key])
    if not objectives.REGISTRY[objective].GENERATES:  # the rest is GRPOConfig's generation
        return
    if args.get("num_generations") is not None:
        spec["num_generations"] = whole_count("training_args.num_generations",
                                         args["num_generations"])
    completion = spec.get("max_completion_length") or grpo.DEFAULT_COMPLETION
    prompt = spec.get("max_prompt_length")
    if prompt is None and "max_prompt_length" not in args and "max_length" not in args:
        prompt = 512  # grpo_config.py max_prompt_length default (TRL 0.14-0.2x)
    if prompt is not None:
        spec["seq_len"] = prompt + completion
        spec["max_prompt_length"] = prompt
    use = args.get("use_vllm")
    if use is not None and flag_value("training_args.use_vllm", use) \
            and args.get("vllm_mode", "server") == "colocate":
        frac = args.get("vllm_gpu_memory_utilization")
        spec["vllm_gpu_memory_utilization"] = float(
            grpo.DEFAULT_VLLM_FRACTION if frac is None else frac)


@converts("training_args", "bf16", "fp16")
def _autocast(args: dict, out: dict) -> None:
    """Trainer's `bf16` / `fp16`: fp32 weights under autocast."""
    bf16, fp16 = bool(args.get("bf16")), bool(args.get("fp16"))
    if bf16 and fp16:
        raise SpecError("training_args.fp16", True, reason="bf16 and fp16 cannot both be set")
    if "bf16" in args or "fp16" in args:
        out["spec"]["precision"] = "bf16-mixed" if bf16 else "fp16-mixed" if fp16 else "fp32"


@converts("training_args", "optim", "optim_args")
def _optim(args: dict, out: dict) -> None:
    """`optim` (+ `optim_args`) -> our optimizer name (`job.optimizers.from_hf`)."""
    optim = str(args.get("optim", HF_DEFAULT_OPTIM))
    optim_args = args.get("optim_args")
    if optim_args is not None and not isinstance(optim_args, str):
        raise SpecError("training_args.optim_args", optim_args,
                        reason='a string "key=value,key=value" as TrainingArguments takes it')
    name = from_hf(optim, optim_args)
    if "optim" in args:
        out["spec"]["optimizer"] = name


@converts("training_args", "max_grad_norm")
def _trainer_loop(args: dict, out: dict) -> None:
    """A TrainingArguments file describes a Trainer run: only the loss outlives the forward,
    gradients clipped at max_grad_norm (0 = off, as Trainer reads it; Trainer's default 1.0)."""
    out["spec"]["loop"] = "trainer"
    out["spec"]["max_grad_norm"] = clip_norm("training_args.max_grad_norm",
                                         args.get("max_grad_norm", HF_DEFAULT_MAX_GRAD_NORM))


@converts("training_args", "torch_empty_cache_steps")
def _empty_cache_steps(args: dict, out: dict) -> None:
    """TrainingArguments `torch_empty_cache_steps`: None = never (our 0), else an int > 0
    (`TrainingArguments.__post_init__` rejects anything else, training_args.py)."""
    if "torch_empty_cache_steps" not in args:
        return
    value = args["torch_empty_cache_steps"]
    if value is None:
        out["spec"]["empty_cache_steps"] = 0
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError("training_args.torch_empty_cache_steps", value,
                        reason="must be null or an integer > 0")
    out["spec"]["empty_cache_steps"] = value


@converts("training_args", "use_liger_kernel", "liger_kernel_config")
def _liger(args: dict, out: dict) -> None:
    """`use_liger_kernel` (+ `liger_kernel_config`): TrainingArguments fields that TRL's
    SFTConfig inherits; Trainer applies Liger with them (transformers `integrations/liger.py`).
    Only Liger's default kernel set is priced (`techniques.liger.check_liger_config`)."""
    if args.get("use_liger_kernel") is None:
        if args.get("liger_kernel_config"):
            raise SpecError("training_args.liger_kernel_config", args["liger_kernel_config"],
                            reason="needs use_liger_kernel: true")
        return
    on = flag_value("training_args.use_liger_kernel", args["use_liger_kernel"])
    if on:
        check_liger_config(args.get("liger_kernel_config"))
    out["spec"]["liger"] = on


@converts("training_args", "tune_mm_mlp_adapter", "lora_enable", "lora_r", "lora_alpha")
def _llava_training(args: dict, out: dict) -> None:
    """LLaVA's `tune_mm_mlp_adapter` (the projector alone) and `lora_enable` (+ `lora_r`,
    `lora_alpha`; haotian-liu/LLaVA llava/train/train.py)."""
    if args.get("tune_mm_mlp_adapter"):
        out["spec"]["train"] = "projector"
    if args.get("lora_enable"):
        out["spec"]["train"] = "lora"
        out["lora"].update({k: args[f"lora_{k}"] for k in ("r", "alpha") if f"lora_{k}" in args})


@converts("training_args", "world_size")
def _world_size(args: dict, out: dict) -> None:
    """The world size is not a TrainingArguments field: a `world_size` key, else $WORLD_SIZE
    (torchrun's), else unset."""
    ws = args.get("world_size", os.environ.get("WORLD_SIZE"))
    if ws is not None:
        try:
            out["parallel"]["world_size"] = int(ws)
        except (TypeError, ValueError):
            raise SpecError("training_args.world_size", ws, reason="must be an integer") from None


@converts("training_args", "fsdp", "deepspeed")
def _sharding(args: dict, out: dict) -> None:
    """`fsdp` options (FSDP_OPTIONS) and `deepspeed` (a config path or object, read as a
    DeepSpeed JSON); not both."""
    out["parallel"].update(fsdp_options(args.get("fsdp")))
    ds = args.get("deepspeed") or None
    if ds is not None and out["parallel"].get("strategy") == "fsdp":
        raise SpecError("training_args.fsdp", args.get("fsdp"),
                        reason="FSDP and DeepSpeed cannot both be set")
    out["deepspeed_where"] = None if ds is None or isinstance(ds, dict) else os.fspath(ds)
    if ds is not None and not isinstance(ds, dict):
        ds = read_json(ds, "training_args.deepspeed")
    out["deepspeed"] = ds


@converts("training_args", "fsdp_config")
def _fsdp_config(args: dict, out: dict) -> None:
    """`fsdp_config` (an object, or a path to a JSON one, as TrainingArguments takes it) of an
    `fsdp` run: reshard_after_forward, checkpointing, a mixed-precision policy
    (`hybridmem.intake.readers.fsdp`). Without `fsdp` transformers ignores it ("useful only
    when --fsdp is specified", training_args.py)."""
    cfg = args.get("fsdp_config")
    if not cfg or out["parallel"].get("strategy") != "fsdp":
        return
    if isinstance(cfg, (str, os.PathLike)):
        cfg = read_json(cfg, "training_args.fsdp_config")
    where = out.get("where", "training_args")
    parallel, spec, sources = fsdp_config.read(cfg, where, "training_args.fsdp_config",
                                               "training_args")
    out["parallel"].update(parallel)
    out["spec"].update(spec)
    out.setdefault("sources", {}).update(sources)


def from_training_args(source: str | os.PathLike | dict, where: str | None = None) -> dict:
    """HF TrainingArguments fields (a JSON object, e.g. `args.to_json_string()`) -> layered kwargs.

    The keys the job schema declares for "training_args" are copied onto their fields (TRL
    SFTConfig's `max_length`, LLaVA's `model_max_length`, ...), the conversions above read the
    rest; any other key is checked (`config_keys.check_keys`): a TrainingArguments / SFTConfig
    / LLaVA field changes no memory, anything else is a warning naming the nearest key.
    Returns {"spec": ..., "parallel": ..., "lora": ..., "deepspeed": dict | None,
    "deepspeed_where": its path | None, "hf": ...};
    "hf" holds the TrainingArguments values (Trainer's defaults where the file is silent) that
    resolve DeepSpeed "auto" keys, and "_given": whether the file set the batch size.
    """
    args = read_json(source, "training_args")
    where = where or key_where(source, "training_args")
    config_keys.check_keys("training_args", args, where, used=used_keys("training_args"),
                           known=config_keys.training_args_known)
    config_keys.unpriced("training_args", args, where, config_keys.TRAINING_ARGS_UNPRICED)
    out: dict = {"spec": {}, "parallel": {}, "lora": {}, "deepspeed": None, "where": where,
                 "sources": {}, "label": where}
    copy_declared("training_args", args, out)
    for conversion in CONVERSIONS["training_args"]:
        before, before_sources = layer_values(out), dict(out["sources"])
        conversion.fn(args, out)
        given = [k for k in conversion.reads if k in args]
        attribute(out, before, before_sources, where, given, "training_args", TRAINER_DEFAULT)
    batch = args.get("per_device_train_batch_size")
    out["hf"] = {"per_device_train_batch_size": HF_DEFAULT_BATCH if batch is None else batch,
                 "bf16": bool(args.get("bf16")), "fp16": bool(args.get("fp16")),
                 "gradient_accumulation_steps": args.get("gradient_accumulation_steps", 1),
                 "_given": batch is not None}
    return out


def fsdp_options(value: object, field: str = "training_args.fsdp") -> dict:
    """FSDP settings of TrainingArguments' `fsdp` options (a space-separated string or a list,
    as axolotl's `fsdp` list too)."""
    if not value:
        return {}
    tokens = value.split() if isinstance(value, str) else list(value) if isinstance(value, list) \
        else None
    if tokens is None:
        raise SpecError(field, value, sorted(FSDP_OPTIONS))
    out: dict = {}
    for tok in tokens:
        if tok == "offload":
            raise SpecError(field, value, reason="FSDP CPU offload is not modelled")
        if tok not in FSDP_OPTIONS:
            raise SpecError(field, tok, sorted(FSDP_OPTIONS))
        out.update(FSDP_OPTIONS[tok])
    return out


# ---------------------------------------------------------------- DeepSpeed JSON
