"""Whether TRL's own fused, chunked LM head runs a job's step: the rule the objectives, the
tiers and the loss techniques read (Liger's fused losses give way to it), kept apart from
`objectives.rules` so that the technique modules can read it without an import cycle."""

from __future__ import annotations

# The first TRL release whose SFT / DPO / KTO / GRPO trainers compute the log-probs through
# `add_fused_lm_head` (trl/trainer/utils.py; trl/kernels/chunked_logprob.py), read from the
# released wheels: 1.14.2 has no trl/kernels/chunked_logprob.py, 1.15.0 has it and calls it
# from sft_trainer.py and dpo_trainer.py
FUSED_HEAD_SINCE = (1, 15)
# The per-token fields each trainer asks `add_fused_lm_head` for (the `outputs=` of its call,
# trl 1.16.0 sft_trainer.py, dpo_trainer.py (without `use_weighting`) and kto_trainer.py)
FUSED_OUTPUTS: dict[str, tuple[str, ...]] = {
    "sft": ("log_probs", "entropy", "is_top1"),
    "dpo": ("log_probs", "entropy", "mean_logits", "is_top1"),
    "kto": ("log_probs", "entropy", "mean_logits"),
    "grpo": ("log_probs", "entropy")}  # grpo_trainer.py __init__


def trl_runs(spec) -> bool:
    """Whether a TRL trainer runs the step: every objective but `sft`, and `sft` under
    `trainer="trl"` (`SFTTrainer`)."""
    return spec.objective != "sft" or spec.trainer == "trl"


def fused_head(spec, trl_version: str | None) -> bool:
    """Whether the step's log-probs go through TRL's fused, chunked LM head: a TRL trainer with
    the head (`FUSED_HEAD_SINCE`) on `trl_version` (the installed TRL; None: not installed,
    the older full-logits step is priced): SFT's, DPO's, KTO's and GRPO's
    (docs/objectives.md, "TRL's fused head")."""
    from hybridmem.environment import release

    return (spec.objective in FUSED_OUTPUTS and trl_runs(spec) and trl_version is not None
            and release(trl_version) >= FUSED_HEAD_SINCE)


# The TRL trainers whose `compute_loss` returns a loss NOT scaled for gradient accumulation
# (`loss_is_scaled_for_ga = False`: trl 1.16 dpo_trainer.py:494, kto_trainer.py:550,
# reward_trainer.py:330, experimental/orpo/orpo_trainer.py:132): transformers' `training_step`
# (trainer.py 5.24, `if not loss_is_scaled_for_ga: loss = loss / current_gradient_accumulation_steps`)
# divides their loss at every step, accumulation 1 too. GRPOTrainer sets it True; SFTTrainer
# leaves None, scaled by `num_items_in_batch` (its batch has labels).
UNSCALED_LOSS: tuple[str, ...] = ("dpo", "kto", "rm", "orpo")


def loop_divisions(spec) -> tuple[bool, bool]:
    """The new 0-dim tensors the Trainer loop makes of the step's loss before backward:
    (transformers' `loss / current_gradient_accumulation_steps`, accelerate's
    `Accelerator.backward` `loss / gradient_accumulation_steps`, made whenever the run is not
    DeepSpeed: accelerator.py `backward`). The first is held by `training_step` through the
    backward, the second by `backward`; the loss they divide dies with its last name. Priced
    for the TRL trainers; transformers' own `Trainer` SFT step keeps the division at
    accumulation > 1 only, without accelerate's (one 512-byte block, docs/objectives.md)."""
    if not trl_runs(spec):
        return spec.grad_accum > 1, False
    return spec.objective in UNSCALED_LOSS, True
