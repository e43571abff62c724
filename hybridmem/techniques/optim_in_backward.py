"""Optimizer-in-backward: the step fused into backward, one parameter at a time.

Why it saves memory: the optimizer steps each parameter as soon as its gradient is complete and
`zero_grad()` frees that gradient at once, so the gradients of the whole model are never alive
together (the peak holds only the gradient in flight) and each step's temporaries are one
parameter's, not a foreach list over all of them.

As torchtune does it (torchtune/training/memory.py, `create_optim_in_bwd_wrapper` /
`register_optim_in_bwd_hooks`): one optimizer per trainable parameter
(`{p: optimizer([p]) for p in model.parameters()}`), and on each parameter a
`register_post_accumulate_grad_hook(optim_step)` whose `optim_step` calls
`optim_dict[param].step()` then `optim_dict[param].zero_grad()` (set_to_none: the grad is freed).
The hook fires once per backward per parameter, after AccumulateGrad has written `.grad` (a tied
weight's two contributions are summed in autograd's input buffer first), so the state is created
lazily during iteration 0's backward, layer by layer, last layer first.

A technique behind `techniques.protocol` (off any axis): the rules live here once; the trace
tier (`trace/runner.py`) and the CUDA harness (`harness/workload.py`) build the job's optimizer
through the protocol's `optimizer` hook (`techniques.optimizer`), and the analytic tier's
timeline steps each parameter in backward where the job asks (`timeline.py`, `events.py`).
"""

from __future__ import annotations

from collections.abc import Callable

from hybridmem.errors import SpecError
from hybridmem.techniques.protocol import Target

NAME = "optimizer-in-backward"
AXIS = None  # combines with the other techniques it does not refuse (`check`)
FLAG = "optimizer_in_backward"
# priced for sft (`techniques.check_objective` refuses it with the TRL objectives, naming why)
OBJECTIVES: tuple[str, ...] = ("sft",)

# Optimizers that can run per parameter in a post-accumulate-grad hook. LoRA-FA (peft
# create_lorafa_optimizer) pairs lora_A with lora_B by name in one optimizer, so it cannot be
# split into one optimizer per parameter.
REFUSED_OPTIMIZERS = {"lora-fa": "LoRA-FA pairs lora_A with lora_B in one optimizer "
                                 "(peft/optimizers/lorafa.py), not one per parameter"}
# Precisions whose loop needs all gradients before any step: GradScaler's unscale_/inf check
# (fp16-mixed) and DeepSpeed BF16_Optimizer's fp32 master-gradient copy (bf16-master).
REFUSED_PRECISIONS = {"fp16-mixed": "GradScaler unscales and checks all gradients before "
                                    "any step",
                      "bf16-master": "the fp32 master gradients are made from all bf16 "
                                     "gradients before the step (DeepSpeed BF16_Optimizer)"}


def check(spec) -> None:
    """One-line SpecError for what cannot run with the step inside backward (torchtune's own
    refusals: recipes/full_finetune_single_device.py raises for gradient accumulation and for
    gradient clipping with `optimizer_in_bwd`; `OptimizerInBackwardWrapper` is single-device
    only, torchtune/training/memory.py)."""
    if not isinstance(spec.optimizer_in_backward, bool):
        raise SpecError("optimizer_in_backward", spec.optimizer_in_backward, [True, False])
    if not spec.optimizer_in_backward:
        return
    if spec.grad_accum > 1:
        raise SpecError("grad_accum", spec.grad_accum, (1,), reason="optimizer_in_backward "
                        "steps in every backward: gradients cannot accumulate")
    if spec.max_grad_norm:
        raise SpecError("max_grad_norm", spec.max_grad_norm, (0,), reason="optimizer_in_backward"
                        " steps each parameter before the total norm is known (no clipping)")
    if spec.optimizer in REFUSED_OPTIMIZERS:
        raise SpecError("optimizer", spec.optimizer, reason="not with optimizer_in_backward: "
                        + REFUSED_OPTIMIZERS[spec.optimizer])
    if spec.precision in REFUSED_PRECISIONS:
        raise SpecError("precision", spec.precision, reason="not with optimizer_in_backward: "
                        + REFUSED_PRECISIONS[spec.precision])
    if spec.liger:
        # Liger's fused linear cross-entropy makes lm_head's weight grad inside the forward
        # (liger_kernel/ops/fused_linear_cross_entropy.py) and hands it over in backward: when
        # the post-accumulate hook would step it is not priced in either tier yet
        raise SpecError("liger", spec.liger, (False,), reason="not priced together with "
                        "optimizer_in_backward yet")
    ps = spec.parallel
    if ps.strategy != "none" or ps.world_size > 1:
        raise SpecError("parallel.strategy", ps.strategy, ("none",), reason="optimizer_in_"
                        "backward is single-device (torchtune OptimizerInBackwardWrapper); "
                        "DDP buckets / ZeRO / FSDP reduce gradients after the hook would step")


def active(spec) -> bool:
    return spec.optimizer_in_backward is True


def applies(target: Target) -> bool:
    return True  # hooks on the parameters, for any model


def kept_logits(spec, b: int, s: int, vocab: int, e: int) -> list[tuple[int, int]] | None:
    return None


def note(spec, model_type: str | None = None, applies: bool = True) -> str | None:
    return None  # the answer's peak phase says it (the step is inside backward)


def install(model, spec, target: Target) -> str | None:
    return None  # the optimizer changes, not the model (`optimizer`)


def apply_real(model, spec) -> None:
    return None  # likewise on CUDA (`optimizer`, called by the harness's `finish_job`)


def optimizer(params: list, build: Callable[[list], object], step=None) -> InBackward:
    """The protocol's `optimizer` hook: the job's optimizer is `make`'s wrapper."""
    return make(params, build, step)


class InBackward:
    """The per-parameter optimizers behind one object with the parts of the `Optimizer` API
    the loops read (`state`, `param_groups`; `step` / `zero_grad` are no-ops: the hooks did
    both), like torchtune's `OptimizerInBackwardWrapper` for checkpointing."""

    def __init__(self, optimizers: dict) -> None:
        self.optimizers = optimizers  # param -> its own optimizer
        self.handles: list = []
        self.on_step: Callable | None = None
        """Called as `on_step(param, optimizer)` right after each hook's `step()`, before its
        `zero_grad()` (the trace tier labels the grad and the new state there)."""
        self.before_step: Callable | None = None

    @property
    def first(self):
        """One of the optimizers (they share a class and settings)."""
        return next(iter(self.optimizers.values()))

    @property
    def state(self) -> dict:
        return {p: st for opt in self.optimizers.values() for p, st in opt.state.items()}

    @property
    def param_groups(self) -> list:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self, closure=None) -> None:  # the hooks stepped already
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:  # the hooks freed the grads
        return None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def make(params: list, build: Callable[[list], object], step=None) -> InBackward:
    """One optimizer per parameter (`build([p])`) and the post-accumulate-grad hooks of
    torchtune's `register_optim_in_bwd_hooks`: `step()` then `zero_grad()` (set_to_none).
    `step(opt)`, if given, replaces `opt.step()` (the trace tier's fake `.item()`)."""
    wrapper = InBackward({p: build([p]) for p in params})

    def optim_step(param) -> None:
        opt = wrapper.optimizers[param]
        if wrapper.before_step is not None:
            wrapper.before_step(param)
        step(opt) if step is not None else opt.step()
        if wrapper.on_step is not None:
            wrapper.on_step(param, opt)
        opt.zero_grad()

    for p in params:
        wrapper.handles.append(p.register_post_accumulate_grad_hook(optim_step))
    return wrapper
