"""torchtitan's job TOML (`torchrun ... -m torchtitan.train --job.config_file x.toml`).

Read as torchtitan's `JobConfig` reads it (torchtitan/config/job_config.py): `[model]` name +
flavor name the model (`llama3` "8B" / "70B" / "405B" are Llama-3.1's shapes: torchtitan
`models/llama3/__init__.py` `llama3_args`, dim 4096 / 8192 / 16384 ...), `[training]` the
batch (`local_batch_size`, formerly `batch_size`), `seq_len`, `max_norm`, the FSDP mixed
precision (`mixed_precision_param`, default bfloat16; `mixed_precision_reduce`, float32) or a
pure `dtype = "bfloat16"`; `[parallelism]` the mesh (`data_parallel_replicate_degree`,
`data_parallel_shard_degree` -1 = the rest, tensor / context / pipeline / expert degrees, the
pipeline schedule, `pipeline_parallel_microbatch_size`, `fsdp_reshard_after_forward`);
`[activation_checkpoint]` full, selective (`selective_ac_option` "op" or every n-th layer) or
none; `[optimizer]` AdamW (`implementation`, default fused).

torchtitan's defaults where the file is silent: FSDP2 over the data-parallel shard ranks with
`MixedPrecisionPolicy(bf16, fp32)` over fp32 params, sequence parallelism with every TP
(`parallelize_llama.apply_tp`: SequenceParallel on the norms), `reshard_after_forward` False
under pipeline parallelism ("default" policy, `apply_fsdp`). The world size is not in the file
(torchrun's `--nproc_per_node` x nodes): `--world-size`, else `$WORLD_SIZE`.
"""

from __future__ import annotations

import os
from pathlib import Path

from hybridmem.errors import SpecError
from hybridmem.job import schema
from hybridmem.intake import config_keys
from hybridmem.intake.dialects.common import LauncherConfig, Layer, model_of, read_config_text
from hybridmem.jsonfile import check_depth

NAME = "torchtitan"
SOURCE = "torchtitan"
DETECT_ORDER = 50  # after the YAML launchers: its markers are its own
SUFFIXES = (".toml",)
"""File suffixes read with `load` rather than as YAML."""

FLAVORS: dict[tuple[str, str], str] = {
    ("llama3", "8B"): "llama-3.1-8b", ("llama3", "70B"): "llama-3.1-70b",
    ("llama3", "405B"): "llama-3.1-405b",
}
"""(model.name, model.flavor) -> preset (torchtitan `llama3_args`: the same dims, vocab 128256)."""

SCHEDULES: dict[str, tuple[str, int | None]] = {
    "1F1B": ("1f1b", 1), "GPipe": ("gpipe", 1), "Interleaved1F1B": ("interleaved-1f1b", None),
    "InterleavedZeroBubble": ("zero-bubble", None), "ZBVZeroBubble": ("zero-bubble", 2),
}
"""torchtitan `pipeline_parallel_schedule` (torch pipelining class names) -> ours and the
stages per rank it implies (None: from `pipeline_parallel_layers_per_stage`)."""

DTYPES = {"bfloat16": "bf16", "float32": "fp32"}

READ = {
    "model": {"name", "flavor", "converters"},
    "training": {"local_batch_size", "batch_size", "seq_len", "max_norm", "dtype",
                 "mixed_precision_param", "mixed_precision_reduce", "compile"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree",
                    "tensor_parallel_degree", "context_parallel_degree",
                    "pipeline_parallel_degree", "expert_parallel_degree",
                    "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
                    "pipeline_parallel_layers_per_stage", "fsdp_reshard_after_forward",
                    "disable_loss_parallel"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
    "optimizer": {"name", "implementation"},
}
KNOWN = {  # torchtitan JobConfig fields with no effect on one step's GPU memory
    "job": None, "profiling": None, "metrics": None, "lr_scheduler": None, "checkpoint": None,
    "comm": None, "validation": None, "fault_tolerance": None, "experimental": None,
    "float8": None, "mx": None, "memory_estimation": None,
    "model": {"tokenizer_path", "hf_assets_path", "print_after_conversion"},
    "training": {"steps", "dataset", "dataset_path", "gc_freq", "seed", "deterministic",
                 "global_batch_size", "warmup_steps", "enable_cpu_offload", "gc_debug",
                 "mixed_precision_reduce"},
    "optimizer": {"lr", "eps", "beta1", "beta2", "weight_decay", "early_step_in_backward"},
    "parallelism": {"enable_async_tensor_parallel", "enable_compiled_autograd",
                    "pipeline_parallel_split_points", "module_fqns_per_model_part",
                    "pipeline_parallel_first_stage_less_layers",
                    "pipeline_parallel_last_stage_less_layers", "context_parallel_rotate_method",
                    "context_parallel_load_balance", "expert_tensor_parallel_degree"},
    "activation_checkpoint": {"per_op_sac_force_recompute_mm_shapes_by_fqns",
                              "preserve_rng_state", "determinism_check", "debug", "early_stop"},
}


def detect(cfg: dict) -> bool:
    """torchtitan's sections: `[parallelism]` or `[model]` with a `flavor`."""
    return isinstance(cfg.get("parallelism"), dict) or (
        isinstance(cfg.get("model"), dict) and "flavor" in cfg["model"])


def parse(text: str, where: str) -> dict:
    """The TOML mapping of a config's text (malformed: one line naming it)."""
    import tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise SpecError("config", where, reason=f"malformed TOML: {err}") from None
    except RecursionError:  # tomllib recurses once per nested inline array / table
        raise SpecError("config", where, reason="TOML nested too deeply") from None
    check_depth(data, "config", where)
    return data


def load(path: str | os.PathLike) -> dict:
    """The TOML mapping of a file (missing, unreadable or malformed: one line naming it)."""
    return parse(read_config_text(path), os.fspath(path))


def _check_keys(raw: dict, where: str) -> None:
    for section, body in raw.items():
        if section not in READ and section not in KNOWN:
            config_keys.check_keys(SOURCE, {section: None}, where, used=(), known=lambda: (
                list(READ) + list(KNOWN)))
            continue
        if not isinstance(body, dict) or KNOWN.get(section, set()) is None:
            continue
        config_keys.check_keys(SOURCE, body, where, used=READ.get(section, ()),
                               known=lambda s=section: KNOWN.get(s) or (), prefix=f"{section}.")


def _int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(where, value, reason="must be an integer")
    return value


def read(raw: dict, where: str, folder: Path, model: str | None = None) -> LauncherConfig:
    """The file's one layer (torchtitan opens no other file that changes memory); `model`:
    the `--model` flag's, read in place of the file's flavor."""
    _check_keys(raw, where)
    out = Layer(where, NAME)
    model = _model(raw.get("model") or {}, out, where, model)
    par = raw.get("parallelism") or {}
    train = raw.get("training") or {}
    _mesh(par, out, where)
    _batch(train, par, out, where)
    _precision(train, par, out, where)
    _checkpointing(raw.get("activation_checkpoint") or {}, out, where)
    per_stage = out.data.pop("layers_per_stage", None)
    if per_stage is not None:
        from hybridmem.intake.dialects.common import model_data

        layers, pp = int(model_data(model)["num_hidden_layers"]), out.data["parallel"]["pp"]
        if layers % (pp * per_stage):
            raise SpecError(f"{where}: parallelism.pipeline_parallel_layers_per_stage", per_stage,
                            reason=f"pp x layers per stage does not divide the {layers} layers")
        out.set("pp_virtual_stages", layers // (pp * per_stage),
                "parallelism.pipeline_parallel_layers_per_stage")
    _optimizer(raw.get("optimizer") or {}, out, where)
    ws = os.environ.get("WORLD_SIZE")
    if ws is not None:
        try:
            out.data["parallel"]["world_size"] = int(ws)
        except ValueError:
            raise SpecError("WORLD_SIZE", ws, reason="must be an integer") from None
        out.data["sources"]["world_size"] = "$WORLD_SIZE"
    return LauncherConfig(NAME, model, [out.data], {})


def _model(node: dict, out: Layer, where: str, override: str | None = None) -> str:
    if override is not None:
        model, hub_id = model_of(None, where, "model", override=override)
        out.set("model", model, note=hub_id)
        return model
    key = (str(node.get("name", "llama3")), str(node.get("flavor", "")))
    if key not in FLAVORS:
        raise SpecError(f"{where}: model.flavor", key[1],
                        [f"{n} {f}" for n, f in FLAVORS], reason=f"no preset for {key[0]} {key[1]!r}")
    out.set("model", FLAVORS[key], "model.name", "model.flavor")
    converters = node.get("converters") or []
    if converters:
        config_keys.warn(f"{where}: torchtitan key 'model.converters'={converters!r} is not "
                         "priced (float8 / mx weights and gathers); priced in bf16")
    return FLAVORS[key]


def _mesh(par: dict, out: Layer, where: str) -> None:
    """The parallel degrees declared on the fields (`keys={"torchtitan": ...}`) and the
    schedule."""
    for key, metas in schema.config_keys(SOURCE).items():
        section, name = key.split(".", 1)
        if section != "parallelism" or name not in par:
            continue
        meta = metas[0]
        if meta.name in ("tp", "cp", "pp", "ep", "dp_replicate"):
            out.set(meta.key, _int(par[name], f"{where}: {key}"), key)
    shard = _int(par.get("data_parallel_shard_degree", -1), f"{where}: parallelism."
                 "data_parallel_shard_degree")
    if shard > 0:
        out.set("dp_shard", shard, "parallelism.data_parallel_shard_degree")
    if shard == -1 or shard > 1:
        # apply_fsdp over dp_shard (-1: whatever is left; one rank: torchtitan shards nothing)
        out.data["multi_gpu_strategy"] = "fsdp"
        if shard > 1:
            out.set("strategy", "fsdp", "parallelism.data_parallel_shard_degree")
    if par.get("tensor_parallel_degree", 1) > 1:
        out.set("sequence_parallel", True, "parallelism.tensor_parallel_degree",
                note="torchtitan applies SequenceParallel with every TP")
    if par.get("pipeline_parallel_degree", 1) > 1:
        _schedule(par, out, where)
    policy = par.get("fsdp_reshard_after_forward", "default")
    if policy not in ("default", "always", "never"):
        raise SpecError(f"{where}: parallelism.fsdp_reshard_after_forward", policy,
                        ("default", "always", "never"))
    pp = par.get("pipeline_parallel_degree", 1) > 1
    if policy != "default" or pp:
        out.set("reshard_after_forward", policy == "always" or (policy == "default" and not pp),
                "parallelism.fsdp_reshard_after_forward")


def _schedule(par: dict, out: Layer, where: str) -> None:
    name = str(par.get("pipeline_parallel_schedule", "1F1B"))
    if name not in SCHEDULES:
        raise SpecError(f"{where}: parallelism.pipeline_parallel_schedule", name, SCHEDULES)
    ours, v = SCHEDULES[name]
    out.set("pp_schedule", ours, "parallelism.pipeline_parallel_schedule")
    per_stage = par.get("pipeline_parallel_layers_per_stage")
    if v is None and per_stage is None:
        v = 2  # torchtitan's looped schedules default to two stages per rank
    if v is None:
        out.data["layers_per_stage"] = _int(per_stage, f"{where}: parallelism."
                                            "pipeline_parallel_layers_per_stage")
    else:
        out.set("pp_virtual_stages", v, "parallelism.pipeline_parallel_schedule")


def _batch(train: dict, par: dict, out: Layer, where: str) -> None:
    key = "local_batch_size" if "local_batch_size" in train else "batch_size"
    local = _int(train.get(key, 8), f"{where}: training.{key}")  # JobConfig default 8
    micro = local
    if par.get("pipeline_parallel_degree", 1) > 1:
        micro = _int(par.get("pipeline_parallel_microbatch_size", 1),
                     f"{where}: parallelism.pipeline_parallel_microbatch_size")
        if local % micro:
            raise SpecError(f"{where}: parallelism.pipeline_parallel_microbatch_size", micro,
                            reason=f"does not divide training.{key}={local}")
        out.set("pp_microbatches", local // micro, f"training.{key}",
                "parallelism.pipeline_parallel_microbatch_size")
    out.set("micro_batch", micro, f"training.{key}")
    out.set("seq_len", _int(train.get("seq_len", 2048), f"{where}: training.seq_len"),
            "training.seq_len")
    norm = train.get("max_norm", 1.0)
    out.set("max_grad_norm", float(norm), "training.max_norm")
    if train.get("compile"):
        config_keys.warn(f"{where}: torchtitan key 'training.compile'=true is not priced; "
                         "torch.compile fuses kernels and saves fewer activations")


def _precision(train: dict, par: dict, out: Layer, where: str) -> None:
    """FSDP2's MixedPrecisionPolicy over fp32 params (`bf16-mixed` with the policy's dtypes),
    or pure `training.dtype = bfloat16` (params, grads and state in bf16)."""
    dtype = DTYPES.get(str(train.get("dtype", "float32")))
    if dtype is None:
        raise SpecError(f"{where}: training.dtype", train.get("dtype"), DTYPES)
    if dtype == "bf16":
        out.set("precision", "bf16", "training.dtype")
        return
    param = DTYPES.get(str(train.get("mixed_precision_param", "bfloat16")))
    reduce = DTYPES.get(str(train.get("mixed_precision_reduce", "float32")))
    if param is None or reduce is None:
        raise SpecError(f"{where}: training.mixed_precision_param", train.get(
            "mixed_precision_param"), DTYPES)
    out.set("precision", "bf16-mixed" if param == "bf16" else "fp32",
            "training.mixed_precision_param")
    out.set("mp_param_dtype", param, "training.mixed_precision_param")
    out.set("mp_reduce_dtype", reduce, "training.mixed_precision_reduce")


def _checkpointing(node: dict, out: Layer, where: str) -> None:
    mode = node.get("mode", "selective")
    if mode not in ("none", "full", "selective"):
        raise SpecError(f"{where}: activation_checkpoint.mode", mode, ("none", "full", "selective"))
    out.set("grad_ckpt", mode != "none", "activation_checkpoint.mode")
    if mode == "selective":
        option = str(node.get("selective_ac_option", "2"))
        if option == "op":
            out.set("grad_ckpt_policy", "ops", "activation_checkpoint.selective_ac_option")
        elif option.isdigit() and int(option) > 0:
            out.set("grad_ckpt_policy", f"every:{option}",
                    "activation_checkpoint.selective_ac_option")
        else:
            raise SpecError(f"{where}: activation_checkpoint.selective_ac_option", option,
                            ("op", "<positive int>"))


def _optimizer(node: dict, out: Layer, where: str) -> None:
    name = node.get("name", "AdamW")
    if name not in ("AdamW", "Adam"):
        raise SpecError(f"{where}: optimizer.name", name, ("AdamW", "Adam"))
    impl = node.get("implementation", "fused")
    if impl not in ("fused", "foreach", "for-loop"):
        raise SpecError(f"{where}: optimizer.implementation", impl, ("fused", "foreach", "for-loop"))
    out.set("optimizer", "adamw-fused" if impl == "fused" else "adamw", "optimizer.implementation")
