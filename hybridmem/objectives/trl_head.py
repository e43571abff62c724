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
