"""accelerate's own config file (`accelerate launch --config_file FILE`, the YAML `accelerate
config` writes), read as accelerate reads it.

The file is a `ClusterConfig` (accelerate commands/config/config_args.py): `distributed_type`
(NO, MULTI_GPU, FSDP, DEEPSPEED, ...), `mixed_precision` (no, fp16, bf16), `num_processes`, and
a `fsdp_config` / `deepspeed_config` block. It names no model (the script does): give `--model`
or a second file. What the keys mean for memory:

- `distributed_type`: NO = one process, MULTI_GPU = DDP, FSDP = FSDP (accelerate's
  FullyShardedDataParallelPlugin; `fsdp_config` read as TrainingArguments' is, `fsdp_`
  prefixes and all: `hybridmem.intake.readers.fsdp`), DEEPSPEED = ZeRO at
  `deepspeed_config.zero_stage` (or the JSON `deepspeed_config_file` names).
- `mixed_precision` bf16 / fp16: torch.autocast over the forward (`bf16-mixed` /
  `fp16-mixed`). Under FSDP2 accelerate upcasts the low-precision parameters to fp32 before
  sharding (utils/fsdp_utils.py `fsdp2_prepare_model`: "FSDP upcast of low precision
  parameters to fp32 (since mixed_precision != 'no')") and `set_mixed_precision` builds the
  policy with param_dtype = reduce_dtype = that dtype (utils/dataclasses.py
  FullyShardedDataParallelPlugin; `MixedPrecision(param_dtype=dtype, reduce_dtype=dtype,
  ...)` for FSDP1): `--mp-param-dtype` = `--mp-reduce-dtype` = bf16, unless the file's
  `fsdp_config.mixed_precision_policy` says otherwise. Under DeepSpeed it enables the config's
  `bf16` / `fp16` (DeepSpeedPlugin.set_mixed_precision): bf16 weights, fp32 master copies.
- `num_processes`: the world size (GPUs in all).
"""

from __future__ import annotations

from pathlib import Path

from hybridmem.errors import SpecError
from hybridmem.job import schema
from hybridmem.jsonfile import read_json_object
from hybridmem.intake import config_keys
from hybridmem.intake.readers import fsdp as fsdp_config
from hybridmem.intake.readers.common import typed_value
from hybridmem.intake.dialects.common import Layer, LauncherConfig, local_file

NAME = "accelerate"
SOURCE = "accelerate"
DETECT_ORDER = 40  # last: `distributed_type` is the launch config's, beside no training keys

READ: tuple[str, ...] = ("distributed_type", "mixed_precision", "num_processes", "fsdp_config",
                         "deepspeed_config", "num_machines")
"""Keys this reader prices."""
# The other ClusterConfig / BaseConfig fields (commands/config/config_args.py): launch
# plumbing, TPU, dynamo, no memory effect here
KNOWN: frozenset[str] = frozenset({
    "compute_environment", "use_cpu", "debug", "machine_rank", "gpu_ids", "main_process_ip",
    "main_process_port", "rdzv_backend", "same_network", "main_training_function",
    "enable_cpu_affinity", "fp8_config", "tp_config", "megatron_lm_config", "ipex_config",
    "mpirun_config", "downcast_bf16", "tpu_name", "tpu_zone", "tpu_use_cluster",
    "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env", "dynamo_config",
    "parallelism_config",
})
# deepspeed_config keys (commands/config/cluster.py, DeepSpeedPlugin): the ones read, and the
# launcher-only rest
DS_READ: tuple[str, ...] = ("deepspeed_config_file", "zero_stage", "offload_optimizer_device",
                            "offload_param_device", "gradient_accumulation_steps",
                            "gradient_clipping")
DS_KNOWN: frozenset[str] = frozenset({
    "offload_optimizer_nvme_path", "offload_param_nvme_path", "zero3_init_flag",
    "zero3_save_16bit_model", "deepspeed_multinode_launcher", "deepspeed_hostfile",
    "deepspeed_exclusion_filter", "deepspeed_inclusion_filter", "deepspeed_moe_layer_cls_names",
})
DISTRIBUTED: dict[str, str] = {"NO": "none", "MULTI_GPU": "ddp", "FSDP": "fsdp",
                               "DEEPSPEED": "zero"}
"""`distributed_type` -> strategy (DEEPSPEED: zeroN, N from the DeepSpeed config)."""
AMP: dict[str, str] = {"no": "", "bf16": "bf16-mixed", "fp16": "fp16-mixed"}
"""`mixed_precision` -> precision (accelerate's autocast over fp32 weights); `no` casts nothing,
so the precision is the script's: the model's default, or `--precision`."""


def detect(cfg: dict) -> bool:
    """accelerate's required key (`process_config`: "A `distributed_type` must be specified")."""
    return "distributed_type" in cfg


def read(raw: dict, where: str, folder: Path, model: str | None = None) -> LauncherConfig:
    """The file's layer (no model); a DeepSpeed config built from `deepspeed_config` as
    accelerate's DeepSpeedPlugin does, or the JSON it names."""
    config_keys.check_keys(SOURCE, raw, where, used=READ, known=lambda: KNOWN)
    out = Layer(where, NAME)
    kind = str(raw.get("distributed_type"))
    if kind not in DISTRIBUTED:
        raise SpecError(f"{where}: distributed_type", kind, sorted(DISTRIBUTED))
    amp = str(raw.get("mixed_precision") or "no")
    if amp not in AMP:
        raise SpecError(f"{where}: mixed_precision", amp, sorted(AMP),
                        reason="fp8 is not priced")
    if amp != "no":  # no: the weights as the script loads them (the model's default)
        out.set("precision", AMP[amp], "mixed_precision")
    if raw.get("num_processes") is not None and int(raw.get("num_processes")) > 0:
        out.set("world_size", typed_value(f"{where}: num_processes",
                                          schema.BY_KEY["world_size"], raw["num_processes"]),
                "num_processes")
    deepspeed = ds_where = None
    if kind == "FSDP":
        _fsdp(raw, out, where, amp)
    elif kind == "DEEPSPEED":
        deepspeed, ds_where = _deepspeed(raw, where, folder, amp)
    else:
        out.set("strategy", DISTRIBUTED[kind], "distributed_type")
    hf = {"per_device_train_batch_size": 1, "bf16": amp == "bf16", "fp16": amp == "fp16",
          "gradient_accumulation_steps": 1, "_given": False}
    return LauncherConfig(NAME, None, [out.data], hf, deepspeed, ds_where)


def _fsdp(raw: dict, out: Layer, where: str, amp: str) -> None:
    """FSDP: the strategy, accelerate's mixed-precision policy (module docstring), then the
    `fsdp_config` block, whose own `mixed_precision_policy` wins."""
    out.set("strategy", "fsdp", "distributed_type")
    if amp != "no":
        out.set("mp_param_dtype", amp, "mixed_precision", note="accelerate's FSDP policy")
        out.set("mp_reduce_dtype", amp, "mixed_precision", note="accelerate's FSDP policy")
    cfg = raw.get("fsdp_config") or {}
    if cfg.get("fsdp_version", cfg.get("version")) not in (None, 2, "2"):
        config_keys.warn(f"{where}: accelerate key 'fsdp_config.fsdp_version'="
                         f"{cfg.get('fsdp_version')!r}: FSDP1 is priced as FSDP2 (the same "
                         "sharded states, the flat-parameter layout aside)")
    par, spec, sources = fsdp_config.read(dict(cfg), where, f"{where}: fsdp_config", SOURCE)
    out.merge({"parallel": par, "spec": spec, "sources": sources})


def _deepspeed(raw: dict, where: str, folder: Path, amp: str) -> tuple[dict, str]:
    """`deepspeed_config`: the JSON `deepspeed_config_file` names, else the config accelerate's
    DeepSpeedPlugin builds from the block (zero_optimization stage and offload devices,
    gradient_accumulation_steps, gradient_clipping; `bf16` / `fp16` from mixed_precision)."""
    cfg = raw.get("deepspeed_config") or {}
    if not isinstance(cfg, dict):
        raise SpecError(f"{where}: deepspeed_config", cfg, reason="must be a mapping")
    config_keys.check_keys(SOURCE, cfg, where, prefix="deepspeed_config.", used=DS_READ,
                           known=lambda: DS_KNOWN)
    if cfg.get("deepspeed_config_file"):
        path = local_file(cfg["deepspeed_config_file"], folder)
        return read_json_object(path, f"{where}: deepspeed_config.deepspeed_config_file"), \
            str(path)
    stage = cfg.get("zero_stage", 2)  # cluster.py's prompt default
    zero: dict = {"stage": stage}
    for key, block in (("offload_optimizer_device", "offload_optimizer"),
                       ("offload_param_device", "offload_param")):
        if cfg.get(key) not in (None, "none"):
            zero[block] = {"device": cfg[key]}
    ds: dict = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
                "bf16": {"enabled": amp == "bf16"}, "fp16": {"enabled": amp == "fp16"}}
    if cfg.get("gradient_accumulation_steps") is not None:
        ds["gradient_accumulation_steps"] = cfg["gradient_accumulation_steps"]
    if cfg.get("gradient_clipping") is not None:
        ds["gradient_clipping"] = cfg["gradient_clipping"]
    return ds, f"{where}: deepspeed_config"

