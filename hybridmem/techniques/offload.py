"""Activation offloading (`--offload-activations all|ckpt-inputs`): saved activations kept in
host memory, `all` as TRL's `OffloadActivations`, `ckpt-inputs` as transformers' checkpoint
`offload=True`. A technique behind `techniques.protocol` (off any axis): its modes and clashes
here, torch-free (every `TrainingSpec` checks them); its hooks in torch are `offload_hooks`
(imported only when a model runs), reached by the harness through the protocol's
`checkpointed` and `loop_context` hooks; the analytic terms are `analytic/offloaded.py`
(TRL's thresholds in `kernels`). The trace tier wires the same hooks to its recorder itself
(`trace/runner.py`: its copies are labelled as they are made).
"""

from __future__ import annotations

from hybridmem.errors import SpecError
from hybridmem.techniques.protocol import Target

NAME = "offload"
AXIS = None  # combines with the other techniques
FLAG = "offload_activations"
# priced for sft (`techniques.check_objective` refuses it with the TRL objectives, naming why)
OBJECTIVES: tuple[str, ...] = ("sft",)
MODES: tuple[str, ...] = ("none", "all", "ckpt-inputs")

STUCK = ("offload all: saved tensors of a layer whose output is never used (LLaVA's vision "
         "layers past vision_feature_layer) are packed but never unpacked, so TRL's tracker never "
         "empties and from the second step on its backward stash is never freed "
         "(trl/models/activation_offloading.py: is_first_forward_call needs an empty tracker); ")


def check(spec) -> None:
    """One-line SpecErrors for the field's value and its clashes."""
    mode = spec.offload_activations
    if mode not in MODES:
        raise SpecError("offload_activations", mode, MODES)
    if mode == "ckpt-inputs" and not spec.grad_ckpt:
        raise SpecError("offload_activations", mode, ("none", "all"), reason="ckpt-inputs "
                        "offloads the checkpointed layers' inputs: needs grad_ckpt (--grad-ckpt)")


def active(spec) -> bool:
    return spec.offload_activations != "none"


def applies(target: Target) -> bool:
    return True  # saved-tensor hooks, for any model


def kept_logits(spec, b: int, s: int, vocab: int, e: int) -> list[tuple[int, int]] | None:
    return None


def note(spec, model_type: str | None = None, applies: bool = True) -> str | None:
    return None  # the analytic tier's notes say what stays on the GPU (`offloaded.notes`)


def install(model, spec, target: Target) -> str | None:
    return None  # the trace tier wires the hooks to its recorder (`trace/runner.py`)


def apply_real(model, spec) -> None:
    return None  # applied around checkpointing and the step (`checkpointed`, `loop_context`)


def checkpointed(model, spec, device) -> None:
    """After checkpointing is on: `ckpt-inputs` on the CPU stand-in runs the trace tier's port
    (transformers' `save_on_cpu(pin_memory=True)` raises without an accelerator, torch CPU
    build); on CUDA transformers' own checkpoint offload does it (`job/checkpointing.py`)."""
    if spec.offload_activations != "ckpt-inputs" or str(device).startswith("cuda"):
        return
    from hybridmem.techniques import offload_hooks as hooks

    c = hooks.Copies()
    hooks.enable_ckpt_offload(model, lambda: hooks.SaveOnHost(c.to_host, c.to_device))


def loop_context(model, spec, device):
    """The context each forward runs in: `all` is TRL's offloading context
    (SFTTrainer's `get_act_offloading_ctx_manager`, `offload_hooks.offload_context`)."""
    if spec.offload_activations != "all":
        return None
    from hybridmem.techniques import offload_hooks as hooks

    return hooks.offload_context(model, device)
