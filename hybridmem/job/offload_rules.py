"""The rules of activation offloading that need no torch: the modes, TRL's size threshold and
stash depth, and the spec's clashes (read by the spec, the analytic tier and `job.offload`,
whose hooks need torch; every `TrainingSpec` checks these, so they must import nothing heavy)."""

from __future__ import annotations

from hybridmem.errors import SpecError

MODES: tuple[str, ...] = ("none", "all", "ckpt-inputs")
# TRL get_act_offloading_ctx_manager / OffloadActivations defaults (SFTTrainer passes none)
MIN_OFFLOAD_SIZE = 1024  # bytes: `min_offload_size`, element_size() * nelement()
MAX_FWD_STASH_SIZE = 5  # `max_fwd_stash_size`: ids a device copy outlives its offload by

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
