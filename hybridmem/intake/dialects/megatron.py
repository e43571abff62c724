"""Megatron-LM's command-line arguments (`pretrain_gpt.py --num-layers ...`), as a file of
arguments or the command line itself.

Megatron builds the model from its arguments, not from a config.json, so the reader writes the
HF config of the same shape (`model_config`): a Llama-form decoder (RMSNorm, rotary, SwiGLU),
Mixtral-form with `--num-experts`. A GELU MLP (`--swiglu` absent) is priced as the SwiGLU MLP
of the same parameter count (`ffn x 2/3`, a warning says so), as the analytic tier prices the
Llama family. Where the arguments do not give the vocabulary (`--vocab-size`; Megatron reads
it from the tokenizer), Llama-2's 32000 is used with a warning.

Read (megatron/training/arguments.py names, dashes as underscores): the model dims; the
layout (`--tensor-model-parallel-size`, `--pipeline-model-parallel-size`,
`--context-parallel-size`, `--expert-model-parallel-size`, `--sequence-parallel`,
`--num-layers-per-virtual-pipeline-stage` / `--virtual-pipeline-model-parallel-size` ->
interleaved 1F1B); the batch (`--micro-batch-size`, `--global-batch-size` -> micro-batches per
step when the world size is known, `--seq-length`); `--bf16` / `--fp16` (16-bit params with
fp32 main params: `bf16-master`); `--use-distributed-optimizer` (optimizer state sharded over
the data-parallel ranks: ZeRO-1, `zero1`; else each rank keeps it whole: `ddp`);
`--recompute-granularity full` (gradient checkpointing); `--use-flash-attn` / the
transformer-engine default attention (flash); `--clip-grad`.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from hybridmem.errors import SpecError
from hybridmem.intake import config_keys
from hybridmem.intake.dialects.common import LauncherConfig, Layer, model_of, read_config_text

NAME = "Megatron-LM"
SOURCE = "megatron"
DETECT_ORDER = 60  # after the YAML launchers: its markers are its own
SUFFIXES = (".sh", ".args", ".txt")
"""File suffixes read with `load` rather than as YAML."""

MODEL = {"num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
         "group_query_attention", "num_query_groups", "kv_channels", "vocab_size",
         "max_position_embeddings", "swiglu", "normalization", "position_embedding_type",
         "untie_embeddings_and_output_weights", "num_experts", "moe_router_topk",
         "moe_ffn_hidden_size", "disable_bias_linear", "rotary_base", "norm_epsilon"}
READ = MODEL | {
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "expert_model_parallel_size", "sequence_parallel", "num_layers_per_virtual_pipeline_stage",
    "virtual_pipeline_model_parallel_size", "micro_batch_size", "global_batch_size",
    "seq_length", "bf16", "fp16", "use_distributed_optimizer", "recompute_granularity",
    "recompute_method", "recompute_num_layers", "use_flash_attn", "clip_grad", "optimizer"}
KNOWN = {  # arguments with no effect on one step's GPU memory (megatron/training/arguments.py)
    "lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_decay_iters", "lr_warmup_fraction",
    "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "init_method_std", "train_iters",
    "train_samples", "eval_iters", "eval_interval", "log_interval", "save_interval", "save",
    "load", "data_path", "split", "tokenizer_type", "tokenizer_model", "vocab_file",
    "merge_file", "tensorboard_dir", "seed", "attention_dropout", "hidden_dropout",
    "distributed_backend", "distributed_timeout_minutes", "use_mcore_models",
    "transformer_impl", "overlap_grad_reduce", "overlap_param_gather", "log_throughput",
    "no_masked_softmax_fusion", "attention_softmax_in_fp32", "accumulate_allreduce_grads_in_fp32",
    "wandb_project", "exit_duration_in_mins", "data_cache_path", "no_load_optim", "no_load_rng",
    "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by", "ckpt_format",
    "use_rotary_position_embeddings", "no_position_embedding", "log_timers_to_tensorboard",
}


def detect(cfg: dict) -> bool:
    """Megatron's model arguments (as `parse` returns them)."""
    return "num_layers" in cfg and "hidden_size" in cfg and "num_attention_heads" in cfg


def parse(text: str, where: str) -> dict:
    """`--name value` / `--flag` pairs of a command line or a file of arguments (shell
    continuations, comments and a leading `torchrun ... pretrain_gpt.py` are skipped) ->
    {name with underscores: value (int / float / str; True for a bare flag)}."""
    try:
        tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as err:
        raise SpecError("config", where, reason=f"cannot split the arguments: {err}") from None
    out: dict = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--"):
            i += 1
            continue
        name = tok[2:].replace("-", "_")
        if "=" in name:
            name, value = name.split("=", 1)
            out[name] = _value(value)
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            out[name] = _value(tokens[i + 1])
            i += 1
        else:
            out[name] = True
        i += 1
    if not out:
        raise SpecError("config", where, reason="no --arguments in it (Megatron-LM arguments)")
    return out


def _value(text: str) -> object:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def load(path: str | os.PathLike) -> dict:
    """The arguments of a launch script (missing, unreadable or too long: one line naming it)."""
    return parse(read_config_text(path), os.fspath(path))


def _int(args: dict, key: str, where: str, default: int | None = None) -> int:
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{where}: --{key.replace('_', '-')}", value,
                        reason="must be a positive integer")
    return value


def model_config(args: dict, where: str) -> dict:
    """The HF config of the model Megatron's arguments build (module docstring)."""
    h, heads = _int(args, "hidden_size", where), _int(args, "num_attention_heads", where)
    ffn = _int(args, "ffn_hidden_size", where, 4 * h)
    if not args.get("swiglu"):
        config_keys.warn(f"{where}: a GELU MLP (no --swiglu) is priced as the SwiGLU MLP of "
                         f"the same parameters (intermediate {ffn} x 2/3)")
        ffn = ffn * 2 // 3
    groups = args.get("num_query_groups", heads) if args.get("group_query_attention") else heads
    vocab = args.get("vocab_size")
    if vocab is None:
        config_keys.warn(f"{where}: no --vocab-size (Megatron reads it from the tokenizer); "
                         "priced with 32000")
        vocab = 32000
    data = {"_source": f"Megatron-LM arguments of {where}", "model_type": "llama",
            "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": h,
            "intermediate_size": ffn, "num_attention_heads": heads,
            "num_key_value_heads": groups, "num_hidden_layers": _int(args, "num_layers", where),
            "vocab_size": vocab, "head_dim": args.get("kv_channels", h // heads),
            "max_position_embeddings": args.get("max_position_embeddings",
                                                args.get("seq_length", 4096)),
            "rms_norm_eps": float(args.get("norm_epsilon", 1e-5)),
            "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False)}
    if args.get("num_experts"):
        data.update(model_type="mixtral", architectures=["MixtralForCausalLM"],
                    num_local_experts=args["num_experts"],
                    num_experts_per_tok=args.get("moe_router_topk", 2),
                    intermediate_size=args.get("moe_ffn_hidden_size", ffn))
    return data


def read(args: dict, where: str, folder: Path, model: str | None = None) -> LauncherConfig:
    from hybridmem.models.loader import materialize_config
    import json

    config_keys.check_keys(SOURCE, args, where, used=READ, known=lambda: KNOWN)
    out = Layer(where, NAME)
    if model is not None:  # `--model`, read in place of the arguments' shape
        model, hub_id = model_of(None, where, "model", override=model)
        out.set("model", model, note=hub_id)
    else:
        model = materialize_config(json.dumps(model_config(args, where)))
        out.set("model", model, "num_layers", "hidden_size", note="the arguments' shape")
    par = out.data["parallel"]
    for key, field in (("tensor_model_parallel_size", "tp"), ("pipeline_model_parallel_size", "pp"),
                       ("context_parallel_size", "cp"), ("expert_model_parallel_size", "ep")):
        if key in args:
            out.set(field, _int(args, key, where), key)
    if args.get("sequence_parallel"):
        out.set("sequence_parallel", True, "sequence_parallel")
    layers = args["num_layers"]
    pp = par.get("pp", 1)
    v = args.get("virtual_pipeline_model_parallel_size")
    if "num_layers_per_virtual_pipeline_stage" in args:
        v = layers // (pp * _int(args, "num_layers_per_virtual_pipeline_stage", where))
    if v and v > 1:
        out.set("pp_schedule", "interleaved-1f1b", "num_layers_per_virtual_pipeline_stage")
        out.set("pp_virtual_stages", v, "virtual_pipeline_model_parallel_size")
    micro = _int(args, "micro_batch_size", where, 1)
    out.set("micro_batch", micro, "micro_batch_size")
    out.set("seq_len", _int(args, "seq_length", where, 4096), "seq_length")
    _microbatches(args, out, micro, where)
    sixteen = args.get("bf16") or args.get("fp16")
    out.set("precision", "bf16-master" if sixteen else "fp32", "bf16" if args.get("bf16") else "fp16")
    out.set("strategy", "zero1" if args.get("use_distributed_optimizer") else "ddp",
            "use_distributed_optimizer")
    out.data["multi_gpu_strategy"] = "zero1" if args.get("use_distributed_optimizer") else "ddp"
    full = args.get("recompute_granularity") == "full"
    out.set("grad_ckpt", full, "recompute_granularity")
    # transformer-engine's fused attention / --use-flash-attn: saves q, k, v, out and the lse;
    # selective recompute recomputes the core attention, which then saves the same
    out.set("attn", "flash_attention_2", "use_flash_attn")
    out.set("max_grad_norm", float(args.get("clip_grad", 1.0)), "clip_grad")
    out.set("optimizer", "adamw-fused", "optimizer", note="Apex / TE FusedAdam")
    return LauncherConfig(NAME, model, [out.data], {})


def _microbatches(args: dict, out: Layer, micro: int, where: str) -> None:
    """Megatron's `num_microbatches = global_batch_size / (micro_batch_size x dp)`; dp needs
    the world size (torchrun's, `$WORLD_SIZE`)."""
    gbs, ws = args.get("global_batch_size"), os.environ.get("WORLD_SIZE")
    if gbs is None:
        return
    par = out.data["parallel"]
    model = par.get("tp", 1) * par.get("pp", 1) * par.get("cp", 1)
    if ws is None or not ws.isdigit() or int(ws) % model:
        config_keys.warn(f"{where}: --global-batch-size needs the world size for the "
                         "micro-batches per step; give --pp-microbatches")
        return
    out.set("world_size", int(ws), note="$WORLD_SIZE")
    dp = int(ws) // model
    if gbs % (micro * dp):
        raise SpecError(f"{where}: --global-batch-size", gbs,
                        reason=f"not divisible by micro-batch x dp = {micro * dp}")
    if par.get("pp", 1) > 1:
        out.set("pp_microbatches", gbs // (micro * dp), "global_batch_size")
    else:
        out.set("grad_accum", gbs // (micro * dp), "global_batch_size")
