"""`HybridmemCallback`: the check inside a `transformers.Trainer` run (TRL's trainers too).

    trainer = Trainer(model, args, ..., callbacks=[HybridmemCallback(fail_if_no_fit=True)])

At train begin it builds the job from the live objects (`hybridmem.integrations.live`: the
TrainingArguments or TRL config, the model's config and adapter, the DeepSpeed / FSDP
settings the arguments hold, the world size), prices it, logs the resolved job and the verdict
(rank 0), and with `fail_if_no_fit=True` raises `NoFit` before the first step. On CUDA, after
`measure_after` steps it logs predicted against measured; with `dataset=FOLDER` it appends the
run as a row (`source = "user"`; nothing is written anywhere else).

Which hooks: `on_train_begin` runs after the Trainer has wrapped the model (PEFT, DeepSpeed,
FSDP) and before the first step (transformers trainer.py `_inner_training_loop` calls
`callback_handler.on_train_begin` before the epoch loop); `on_step_end` after each optimizer
step (`state.global_step` counts them).
"""

from __future__ import annotations

from transformers import TrainerCallback

from hybridmem.integrations.check import NoFit, RunCheck, visible_log  # noqa: F401 (NoFit: re-exported)


class HybridmemCallback(TrainerCallback):
    """Predict before the first step, measure after the first steps (module docstring)."""

    def __init__(self, *, gpu: str | None = None, gpu_mem: float | None = None,
                 method: str | None = None, seq_len: int | None = None,
                 fail_if_no_fit: bool = False, measure_after: int = 3,
                 dataset: str | None = None, **fields: object):
        """`gpu` / `gpu_mem`: the GPU the verdict is against (default: this process's GPU;
        none on a CPU). `seq_len`: the sequence length priced when the arguments do not say
        it (TRL's `max_length` does). `fields`: any other job field by schema key (e.g.
        `images_per_sample`). `dataset`: a folder for this run's row (opt-in)."""
        self.check = RunCheck(gpu=gpu, gpu_mem=gpu_mem, method=method,
                              fail_if_no_fit=fail_if_no_fit, measure_after=measure_after,
                              dataset=dataset)
        self.seq_len = seq_len
        self.fields = fields

    def inputs(self, args, model):
        """The run's inputs as `hybridmem predict` would take them (`live.trainer_inputs`)."""
        from hybridmem.integrations.live import trainer_inputs

        return trainer_inputs(args, model, seq_len=self.seq_len, **self.fields)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        self.check.lengths.attach(model)
        say = visible_log().info if state.is_world_process_zero else (lambda line: None)
        self.check.begin(self.inputs(args, model), say)

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:  # rank 0 measures and writes (one row per run)
            self.check.step(state.global_step, visible_log().info)

    def on_train_end(self, args, state, control, **kwargs):
        self.check.end()
