"""SFT: the language-model loss of transformers' `ForCausalLMLoss` (every tier's default), or
TRL's `SFTTrainer` under `trainer="trl"` (from TRL 1.15 through its fused LM head: no full
logits, `step.py`)."""

from __future__ import annotations

NAME = "sft"
ORDER = 0
HEAD = "lm"  # transformers' ForCausalLMLoss: every trait else is the protocol's default
# trl 1.16.0 sft_trainer.py: `add_fused_lm_head(..., outputs=(...))`
FUSED_OUTPUTS: tuple[str, ...] | None = ("log_probs", "entropy", "is_top1")
