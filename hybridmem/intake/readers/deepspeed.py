"""DeepSpeed's JSON -> job fields, its "auto" values resolved as transformers resolves them
(`integrations/deepspeed.py`, `HfTrainerDeepSpeedConfig`): `trainer_config_process` fills batch
size and bf16/fp16 from the TrainingArguments, `trainer_config_finalize` the hidden-size based
keys from the model config.
"""

from __future__ import annotations

import os

from hybridmem.errors import SpecError
from hybridmem.job import schema
from hybridmem.intake import config_keys
from hybridmem.intake.readers.common import (
    flag_value, key_where, read_json, typed_value, used_keys, whole_count,
)
from hybridmem.intake.readers.trainer import HF_DEFAULTS


# DeepSpeed "optimizer.type" -> ours: Adam/AdamW build DeepSpeed's FusedAdam (no foreach
# temporaries; engine `_configure_basic_optimizer`), Lion its FusedLion.
# FusedLion (deepspeed/ops/lion/fused_lion.py) keeps `exp_avg` (zeros_like the fp32 partition)
# and updates in place, as bitsandbytes' 32-bit Lion does: our `lion-32bit`.
DS_OPTIMS: dict[str, str] = {"adam": "adamw-fused", "adamw": "adamw-fused", "lion": "lion-32bit"}


def hidden_size_of(model: str) -> int:
    """The hidden size transformers uses for "auto" DeepSpeed keys (`trainer_config_finalize`:
    config.hidden_size, else max(hidden_sizes), else the text_config's)."""
    from hybridmem.models import load_config

    cfg = load_config(model)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        if getattr(c, "hidden_size", None):
            return int(c.hidden_size)
        if getattr(c, "hidden_sizes", None):
            return int(max(c.hidden_sizes))
    raise SpecError("model", model, reason="config has no hidden_size to resolve DeepSpeed 'auto'")


ZERO = "zero_optimization."
# "auto" keys transformers fills from the model's hidden size h (integrations/deepspeed.py
# `trainer_config_finalize`), by the key it fills; stage-3 ones only with stage 3
AUTO_HIDDEN: dict[str, object] = {"reduce_bucket_size": lambda h: h * h}
AUTO_HIDDEN_STAGE3: dict[str, object] = {
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def zero_keys() -> dict[str, object]:
    """`zero_optimization` key -> the ParallelSpec field it is copied onto (schema-declared
    keys; `stage` and the offload blocks are conversions)."""
    return {key[len(ZERO):]: metas[0] for key, metas in schema.config_keys("deepspeed").items()
            if key.startswith(ZERO) and key not in (ZERO + "stage", ZERO + "offload_optimizer",
                                                     ZERO + "offload_param")}


def from_deepspeed_json(source: str | os.PathLike | dict, *, hidden_size: int | None = None,
                        hf: dict | None = None, where: str | None = None) -> dict:
    """A DeepSpeed config -> layered kwargs, "auto" resolved from `hf` (TrainingArguments values,
    HF defaults when None) and `hidden_size` (the model's; needed only for hidden-size keys).
    Keys neither read nor DeepSpeed's own are warnings (`config_keys`)."""
    cfg = read_json(source, "deepspeed")
    where = where or key_where(source, "deepspeed")
    hf = hf or HF_DEFAULTS
    used = used_keys("deepspeed")
    config_keys.check_keys("deepspeed", cfg, where, used={k.split(".")[0] for k in used},
                           known=lambda: config_keys.DEEPSPEED_KEYS)
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise SpecError("deepspeed.zero_optimization", zero, reason="must be a JSON object")
    config_keys.check_keys("deepspeed", zero, where, prefix=ZERO,
                           used={k[len(ZERO):] for k in used if k.startswith(ZERO)},
                           known=lambda: config_keys.ZERO_KEYS)
    config_keys.unpriced("deepspeed", zero, where, config_keys.ZERO_UNPRICED)
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise SpecError("deepspeed.zero_optimization.stage", stage, [0, 1, 2, 3])
    parallel: dict = {"strategy": f"zero{stage}" if stage else "ddp"}
    sources: dict = {"strategy": f"{where}: {ZERO}stage"}
    auto_hidden = {**AUTO_HIDDEN, **(AUTO_HIDDEN_STAGE3 if stage == 3 else {})}
    for key, meta in zero_keys().items():
        if key not in zero:
            continue
        value = zero[key]
        if value == "auto":
            if key not in auto_hidden:
                # transformers fills no "auto" here (its stage3_ names only,
                # integrations/deepspeed.py `trainer_config_process`), and DeepSpeed drops a
                # leftover "auto" to keep its field default (runtime/config_utils.py
                # `DeepSpeedConfigModel.__init__`, not strict): the schema's default, which is
                # DeepSpeed's
                sources[meta.name] = f"{where}: {ZERO}{key} ('auto' left to DeepSpeed's default)"
                continue
            if hidden_size is None:
                raise SpecError(f"deepspeed.zero_optimization.{key}", "auto",
                                reason="needs the model's hidden size: give --model")
            value = auto_hidden[key](hidden_size)
        parallel[meta.name] = typed_value(f"deepspeed.zero_optimization.{key}", meta, value)
        sources[meta.name] = f"{where}: {ZERO}{key}"
    for key in ("offload_optimizer", "offload_param"):
        block = zero.get(key) or {}
        if not isinstance(block, dict):
            raise SpecError(f"deepspeed.zero_optimization.{key}", block, reason="must be a JSON object")
        device = block.get("device", "none")
        if device not in ("none", "cpu", "nvme"):
            raise SpecError(f"deepspeed.zero_optimization.{key}.device", device, ["none", "cpu", "nvme"])
        # NVMe offload frees the GPU exactly as CPU offload does
        parallel[key] = "none" if device == "none" else "cpu"
        if key in zero:
            sources[key] = f"{where}: {ZERO}{key}.device"
    spec: dict = {"precision": _ds_precision(cfg, hf)}
    on = [k for k in ("bf16", "fp16", "bfloat16") if isinstance(cfg.get(k), dict)
          and cfg[k].get("enabled", False) is not False]
    sources["precision"] = f"{where}: {'/'.join(on)}.enabled" if on else \
        f"{where}: no bf16/fp16 block enabled"
    micro = cfg.get("train_micro_batch_size_per_gpu", "auto")
    spec["micro_batch"] = hf["per_device_train_batch_size"] if micro == "auto" else micro
    if micro != "auto":
        sources["micro_batch"] = f"{where}: train_micro_batch_size_per_gpu"
    if micro != "auto" and micro != hf["per_device_train_batch_size"] and hf.get("_given"):
        # transformers `trainer_config_finalize` refuses mismatches between the two files
        raise SpecError("deepspeed.train_micro_batch_size_per_gpu", micro,
                        reason=f"TrainingArguments say {hf['per_device_train_batch_size']}")
    ws = _world_size_from_batch(cfg, spec["micro_batch"], hf)
    if ws is not None:
        parallel["world_size"] = ws
        sources["world_size"] = f"{where}: train_batch_size"
    opt = cfg.get("optimizer")
    if opt is not None:
        kind = str((opt or {}).get("type", "")).lower() if isinstance(opt, dict) else str(opt)
        if kind not in DS_OPTIMS:
            raise SpecError("deepspeed.optimizer.type", kind, sorted(DS_OPTIMS))
        spec["optimizer"] = DS_OPTIMS[kind]
        sources["optimizer"] = f"{where}: optimizer.type"
    return {"spec": spec, "parallel": parallel, "lora": {}, "sources": sources, "label": where}


def _ds_precision(cfg: dict, hf: dict) -> str:
    """bf16/fp16 "auto" from the TrainingArguments (`trainer_config_process`). DeepSpeed then
    holds the model in 16 bits with an fp32 master partition: priced as bf16-master (fp16 has the
    same bytes); without either, everything is fp32. `bfloat16` is DeepSpeed's older name of the
    bf16 block, read when `bf16` is absent (runtime/config.py `get_bfloat16_config`)."""
    enabled = {}
    for key in ("bf16", "fp16"):
        block = cfg.get(key, cfg.get("bfloat16", {}) if key == "bf16" else {})
        value = block.get("enabled", False) if isinstance(block, dict) else block
        enabled[key] = hf[key] if value == "auto" else flag_value(f"deepspeed.{key}.enabled", value)
    if enabled["bf16"] and enabled["fp16"]:
        raise SpecError("deepspeed.fp16.enabled", True, reason="bf16 and fp16 cannot both be enabled")
    return "bf16-master" if enabled["bf16"] or enabled["fp16"] else "fp32"


def _world_size_from_batch(cfg: dict, micro: int, hf: dict) -> int | None:
    """DeepSpeed asserts train_batch_size == micro * grad_accum * world_size; a numeric
    train_batch_size therefore fixes the world size."""
    total = cfg.get("train_batch_size", "auto")
    if total == "auto" or not isinstance(micro, int):
        return None
    gas = cfg.get("gradient_accumulation_steps", "auto")
    gas = hf.get("gradient_accumulation_steps", 1) if gas == "auto" else gas
    total, gas = whole_count("deepspeed.train_batch_size", total), whole_count(
        "deepspeed.gradient_accumulation_steps", gas)
    if gas == 0 or micro <= 0 or total % (micro * gas):
        raise SpecError("deepspeed.train_batch_size", total,
                        reason=f"is not micro batch {micro} x grad accumulation {gas} x world size")
    return total // (micro * gas)
