"""The first TRL release whose trainers run the step through TRL's own fused, chunked LM head;
which trainers do is each objective's `FUSED_OUTPUTS` (`objectives.fused_head` joins the two)."""

from __future__ import annotations

# The first TRL release whose SFT / DPO / KTO / GRPO trainers compute the log-probs through
# `add_fused_lm_head` (trl/trainer/utils.py; trl/kernels/chunked_logprob.py), read from the
# released wheels: 1.14.2 has no trl/kernels/chunked_logprob.py, 1.15.0 has it and calls it
# from sft_trainer.py and dpo_trainer.py
FUSED_HEAD_SINCE = (1, 15)


def has_fused_head(trl_version: str | None) -> bool:
    """Whether `trl_version` (None: TRL not installed) has the fused head."""
    from hybridmem.environment import release

    return trl_version is not None and release(trl_version) >= FUSED_HEAD_SINCE
