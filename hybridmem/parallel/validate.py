"""Checks of the parallel settings against the rest of the spec (the optimizer, the precision).

`ParallelSpec.__post_init__` checks what it can see alone; these need the whole TrainingSpec, so
they run at the boundary where specs are merged from user inputs and again before estimating.
"""

from __future__ import annotations

from hybridmem.errors import SpecError
from hybridmem.job.spec import TrainingSpec

# ZeRO-Offload steps on the CPU with DeepSpeedCPUAdam; the engine refuses other client
# optimizers with offload (`zero_force_ds_cpu_optimizer`, deepspeed/runtime/engine.py), and HF
# maps `adamw_*` to it. SGD, Lion, Adafactor and bitsandbytes 8-bit have no CPU kernel there.
OFFLOAD_OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw-fused")


def check_parallel(spec: TrainingSpec) -> None:
    """Raise a one-line SpecError for parallel settings the spec's optimizer cannot run."""
    ps = spec.parallel
    if ps.offload_optimizer != "none" and spec.optimizer not in OFFLOAD_OPTIMIZERS:
        raise SpecError("optimizer", spec.optimizer, OFFLOAD_OPTIMIZERS,
                        reason="optimizer offload to the CPU needs DeepSpeedCPUAdam")
    if ps.strategy != "none" and spec.optimizer == "lora-fa":
        # peft/optimizers/lorafa.py pairs the model's own lora_A/lora_B by name and computes
        # A @ A.T on them: only modelled on one GPU (ZeRO/FSDP would hand it flat shards)
        raise SpecError("optimizer", spec.optimizer, reason="LoRA-FA is modelled on one GPU "
                        f"only, not strategy={ps.strategy!r}")
