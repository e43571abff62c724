"""SFT: the language-model loss of transformers' `ForCausalLMLoss` (every tier's default), or
TRL's `SFTTrainer` under `trainer="trl"` (from TRL 1.15 through its fused LM head: no full
logits, `step.py`)."""

from __future__ import annotations

NAME = "sft"
ORDER = 0
LM_LOSS = True
CONCATENATED = False
PADDED = False
DEFAULT_BETA = 0.0
# trl 1.16.0 sft_trainer.py: `add_fused_lm_head(..., outputs=(...))`
FUSED_OUTPUTS: tuple[str, ...] | None = ("log_probs", "entropy", "is_top1")
BATCH_COLUMNS = 0
PRECOMPUTED_COLUMNS = 0
GENERATES = False
SCORE_HEAD = False


def reads_reference(spec) -> bool:
    return False


def prompt_length(spec) -> int:
    return 0


def check(spec) -> None:
    return None  # the fields only other objectives read: `objectives.check`


def note(spec) -> str:
    return ""
