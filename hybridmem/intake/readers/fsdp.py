"""An `fsdp_config` block (TrainingArguments', LLaMA-Factory's, axolotl's) -> FSDP job fields.

transformers strips an `fsdp_` prefix from every key of `fsdp_config` (training_args.py
`__post_init__`: `self.fsdp_config[k[5:]] = v`), and axolotl does the same
(utils/schemas/validation.py `check_fsdp_config_kwargs_prefix`), so `fsdp_reshard_after_forward`
and `reshard_after_forward` are one key. The keys that change memory:

- `reshard_after_forward` (FSDP2, accelerate's FullyShardedDataParallelPlugin: a bool, or an
  FSDP1 sharding-strategy name) and `sharding_strategy` (FSDP1): FULL_SHARD frees the gathered
  parameters after each unit's forward, SHARD_GRAD_OP keeps them until backward
  (= reshard_after_forward False), NO_SHARD is DDP.
- `activation_checkpointing`: accelerate checkpoints every wrapped layer (grad_ckpt on).
- `mixed_precision_policy` (axolotl utils/schemas/fsdp.py, e.g. "bf16"): accelerate's
  `FullyShardedDataParallelPlugin.set_mixed_precision` builds the policy with param_dtype =
  reduce_dtype = that dtype; an object {param_dtype, reduce_dtype} names both.
- `offload_params` / `cpu_offload`: FSDP CPU offload is not modelled (a one-line error).

The other keys (wrapping policy, prefetch, state-dict type, loading) change no peak memory.
"""

from __future__ import annotations

from hybridmem.errors import SpecError
from hybridmem.intake import config_keys

# accelerate utils/constants.py FSDP_SHARDING_STRATEGY (and FSDP2's bool reshard_after_forward)
SHARDING: dict[str, dict] = {
    "FULL_SHARD": {"strategy": "fsdp", "reshard_after_forward": True},
    "SHARD_GRAD_OP": {"strategy": "fsdp", "reshard_after_forward": False},
    "NO_SHARD": {"strategy": "ddp"},
}
# torch dtype names a mixed-precision policy may use -> ParallelSpec MP_DTYPES
MP_DTYPES: dict[str, str] = {"bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
                             "fp16": "fp16", "float16": "fp16", "torch.float16": "fp16",
                             "fp32": "fp32", "float32": "fp32", "torch.float32": "fp32",
                             "no": "fp32"}
OFFLOAD_KEYS: tuple[str, ...] = ("offload_params", "cpu_offload")
READ: tuple[str, ...] = ("version", "reshard_after_forward", "sharding_strategy",
                         "activation_checkpointing", "mixed_precision_policy", *OFFLOAD_KEYS)
# fsdp_config keys of transformers (training_args.py `fsdp_config` docs), accelerate's
# FullyShardedDataParallelPlugin and axolotl's FSDPConfig that change no peak memory
KNOWN: frozenset[str] = frozenset({
    "min_num_params", "transformer_layer_cls_to_wrap", "backward_prefetch", "forward_prefetch",
    "limit_all_gathers", "use_orig_params", "sync_module_states", "cpu_ram_efficient_loading",
    "auto_wrap_policy", "state_dict_type", "final_state_dict_type", "cpu_offload_pin_memory",
    "activation_cpu_offload", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings",
    "ignored_modules", "use_fsdp2",
})


def _strip(config: dict) -> dict:
    return {(k[5:] if isinstance(k, str) and k.startswith("fsdp_") else k): v
            for k, v in config.items()}


def _flag(field: str, value: object) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"  # accelerate's yaml / env strings
    if not isinstance(value, bool):
        raise SpecError(field, value, [True, False])
    return value


def _mp(field: str, policy: object) -> dict:
    if isinstance(policy, dict):
        out = {}
        for key, name in (("param_dtype", "mp_param_dtype"), ("reduce_dtype", "mp_reduce_dtype")):
            if policy.get(key) is not None:
                if str(policy[key]) not in MP_DTYPES:
                    raise SpecError(f"{field}.{key}", policy[key], sorted(MP_DTYPES))
                out[name] = MP_DTYPES[str(policy[key])]
        return out
    if str(policy) not in MP_DTYPES:
        raise SpecError(field, policy, sorted(MP_DTYPES))
    dtype = MP_DTYPES[str(policy)]
    return {"mp_param_dtype": dtype, "mp_reduce_dtype": dtype}


def read(config: dict | None, where: str, field: str, source: str) -> tuple[dict, dict, dict]:
    """(parallel fields, spec fields, flat key -> "WHERE: key") from an `fsdp_config` object;
    `field` names it in errors (e.g. "train.yaml: fsdp_config"), `source` is the config_keys
    source whose label the unknown-key warnings carry. Keys are read with or without `fsdp_`."""
    if not config:
        return {}, {}, {}
    if not isinstance(config, dict):
        raise SpecError(field, config, reason="must be an object of FSDP settings")
    raw = {(k[5:] if isinstance(k, str) and k.startswith("fsdp_") else k): k for k in config}
    cfg = _strip(config)
    config_keys.check_keys(source, cfg, where, prefix="fsdp_config.", used=READ, known=lambda: KNOWN)
    parallel: dict = {}
    spec: dict = {}
    sources: dict = {}

    def said(key: str, *names: str) -> None:
        for name in names:
            sources[name] = f"{where}: fsdp_config.{raw[key]}"

    for key in OFFLOAD_KEYS:
        if key in cfg and cfg[key] not in (None, False) and _flag(f"{field}.{key}", cfg[key]):
            raise SpecError(f"{field}.{raw[key]}", cfg[key], [False],
                            reason="FSDP CPU offload is not modelled")
    for key in ("sharding_strategy", "reshard_after_forward"):
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, str) and value.upper() in SHARDING:
            parallel.update(SHARDING[value.upper()])
            said(key, *SHARDING[value.upper()])
        elif key == "reshard_after_forward":
            parallel["reshard_after_forward"] = _flag(f"{field}.{raw[key]}", value)
            said(key, "reshard_after_forward")
        else:  # HYBRID_SHARD and friends replicate across nodes: not one of our strategies
            raise SpecError(f"{field}.{raw[key]}", value, sorted(SHARDING))
    if cfg.get("activation_checkpointing") is not None:
        spec["grad_ckpt"] = _flag(f"{field}.activation_checkpointing",
                                  cfg["activation_checkpointing"])
        said("activation_checkpointing", "grad_ckpt")
    if cfg.get("mixed_precision_policy") is not None:
        mp = _mp(f"{field}.mixed_precision_policy", cfg["mixed_precision_policy"])
        parallel.update(mp)
        said("mixed_precision_policy", *mp)
    return parallel, spec, sources
