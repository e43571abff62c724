"""`check_accelerator`: the check in a plain accelerate script, once the model is prepared.

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    check = check_accelerator(accelerator, model, micro_batch=8, seq_len=2048)
    for step, batch in enumerate(loader, 1):
        ...
        check.step(step)          # once after `measure_after` steps: predicted vs measured

The accelerator's state is what `accelerate launch --config_file` gave it, so it is handed to
the same reader as `hybridmem predict --config accelerate.yaml` (`intake/dialects/
accelerate.py`): `distributed_type`, `mixed_precision`, `num_processes`, and the DeepSpeed
plugin's full config (`deepspeed_plugin.deepspeed_config`) as the DeepSpeed JSON.
"""

from __future__ import annotations

from pathlib import Path

from hybridmem.integrations.check import RunCheck, visible_log
from hybridmem.integrations.live import LiveInputs, base_model, model_config_path, peft_dict


def accelerate_mapping(accelerator) -> dict:
    """The accelerate config file this accelerator's state amounts to (its keys)."""
    state = accelerator.state
    kind = getattr(state.distributed_type, "name", str(state.distributed_type))
    return {"distributed_type": kind if kind in ("NO", "MULTI_GPU", "FSDP", "DEEPSPEED") else "NO",
            "mixed_precision": str(accelerator.mixed_precision or "no"),
            "num_processes": int(accelerator.num_processes)}


def check_accelerator(accelerator, model, *, micro_batch: int, seq_len: int,
                      gpu: str | None = None, gpu_mem: float | None = None,
                      method: str | None = None, fail_if_no_fit: bool = False,
                      measure_after: int = 3, dataset: str | None = None,
                      **fields: object) -> RunCheck:
    """Price the prepared run (logged on the main process; `NoFit` with `fail_if_no_fit`) and
    return its `RunCheck`: call `.step(n)` after step n, `.end()` when training ends."""
    from hybridmem.intake.dialects import read_mapping

    mapping = accelerate_mapping(accelerator)
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    deepspeed = dict(plugin.deepspeed_config) if plugin is not None else None
    if deepspeed is not None:
        mapping["distributed_type"] = "MULTI_GPU" if mapping["num_processes"] > 1 else "NO"
    config = read_mapping(mapping, "accelerator state", Path.cwd(), "accelerate")
    inner = accelerator.unwrap_model(model)
    name = getattr(base_model(inner).config, "_name_or_path", "") or type(inner).__name__
    overrides = {"model": model_config_path(inner), "micro_batch": micro_batch,
                 "seq_len": seq_len, "peft_config": peft_dict(inner), **fields}
    check = RunCheck(gpu=gpu, gpu_mem=gpu_mem, method=method, fail_if_no_fit=fail_if_no_fit,
                     measure_after=measure_after, dataset=dataset)
    check.lengths.attach(inner)
    say = visible_log().info if accelerator.is_main_process else (lambda line: None)
    check.begin(LiveInputs(deepspeed=deepspeed, config=config, overrides=overrides,
                           names={"flag --model": f"model.config ({name})"}), say)
    return check
