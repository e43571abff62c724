"""`HybridmemLightningCallback`: the check inside a Lightning run (imported only when used).

    trainer = L.Trainer(precision="bf16-mixed", devices=4, strategy="fsdp",
                        callbacks=[HybridmemLightningCallback(micro_batch=8, seq_len=2048)])

Lightning has no TrainingArguments, so the job's run-time settings come from the
`lightning.Trainer` (precision, world size, strategy) and the caller (micro-batch, seq); the
model is the `transformers` model the LightningModule holds (`model=` names its attribute,
default `model`), its adapter read as the Trainer callback reads it (`live.py`). All of it goes
through `hybridmem predict`'s intake as flags would. Hooks: `on_fit_start` runs before the
first step, `on_train_batch_end` after each (lightning/pytorch/callbacks/callback.py).
"""

from __future__ import annotations

import lightning.pytorch as pl

from hybridmem.integrations.check import RunCheck, visible_log
from hybridmem.integrations.live import LiveInputs, base_model, model_config_path, peft_dict

PRECISIONS: dict[str, str] = {"bf16-mixed": "bf16-mixed", "16-mixed": "fp16-mixed",
                              "32-true": "fp32", "32": "fp32", "bf16-true": "bf16",
                              "16-true": "fp16"}
"""Lightning's `Trainer(precision=...)` -> ours (lightning/fabric/connector.py
`_PRECISION_INPUT`; "-true" casts the weights, "-mixed" autocasts over fp32 weights)."""
STRATEGIES: dict[str, str] = {"DDPStrategy": "ddp", "FSDPStrategy": "fsdp",
                              "DeepSpeedStrategy": "zero"}
"""Lightning strategy class -> ours (DeepSpeed: zeroN at the strategy's `stage`)."""


def lightning_fields(trainer) -> dict:
    """precision, world_size and strategy of a `lightning.Trainer`, by job-schema key."""
    out: dict = {"world_size": trainer.world_size}
    precision = PRECISIONS.get(str(trainer.precision))
    if precision is not None:
        out["precision"] = precision
    kind = STRATEGIES.get(type(trainer.strategy).__name__)
    if kind == "zero":
        kind = f"zero{getattr(trainer.strategy, 'config', {}).get('zero_optimization', {}).get('stage', 2)}"
    if kind is not None and trainer.world_size > 1:
        out["strategy"] = kind
    return out


class HybridmemLightningCallback(pl.Callback):
    """Predict before the first step, measure after the first steps (module docstring)."""

    def __init__(self, *, micro_batch: int, seq_len: int, model: str = "model",
                 gpu: str | None = None, gpu_mem: float | None = None, method: str | None = None,
                 fail_if_no_fit: bool = False, measure_after: int = 3,
                 dataset: str | None = None, **fields: object):
        self.check = RunCheck(gpu=gpu, gpu_mem=gpu_mem, method=method,
                              fail_if_no_fit=fail_if_no_fit, measure_after=measure_after,
                              dataset=dataset)
        self.attribute = model
        self.fields = {"micro_batch": micro_batch, "seq_len": seq_len, **fields}

    def on_fit_start(self, trainer, pl_module):
        model = getattr(pl_module, self.attribute)
        overrides = {"model": model_config_path(model), **lightning_fields(trainer),
                     **self.fields, "peft_config": peft_dict(model)}
        name = getattr(base_model(model).config, "_name_or_path", "") or type(model).__name__
        self.check.lengths.attach(model)
        say = visible_log().info if trainer.is_global_zero else (lambda line: None)
        self.check.begin(LiveInputs(overrides=overrides,
                                    names={"flag --model": f"model.config ({name})"}), say)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            self.check.step(trainer.global_step, visible_log().info)

    def on_fit_end(self, trainer, pl_module):
        self.check.end()
