"""ORPO (TRL `ORPOTrainer`): the concatenated policy forward (2 x micro_batch sequences), no
reference; the SFT NLL on the chosen half beside the odds-ratio term (`step.py`)."""

from __future__ import annotations

from hybridmem.objectives import rules

NAME = "orpo"
ORDER = 2
LM_LOSS = False
CONCATENATED = True
# trl/experimental/orpo `DPODataCollatorWithPadding`: chosen and rejected padded to the longest
PADDED = True
DEFAULT_BETA = 0.1  # trl/trainer/orpo_config.py
FUSED_OUTPUTS: tuple[str, ...] | None = None  # ORPOTrainer has no fused head (trl 1.16)
BATCH_COLUMNS = 1  # the collator's attention mask beside ids and labels
PRECOMPUTED_COLUMNS = 0
GENERATES = False
SCORE_HEAD = False
# its trainer's `loss_is_scaled_for_ga = False` (trl 1.16 trl/experimental/orpo/orpo_trainer.py:132):
# transformers' loop divides the loss at every step (`objectives.loop_divisions`)
UNSCALED_LOSS = True


def reads_reference(spec) -> bool:
    return False


def prompt_length(spec) -> int:
    """0: `max_prompt_length` only bounds the prompt (TRL truncates to it): the worst case."""
    return 0


def check(spec) -> None:
    rules.no_reference(spec, NAME)
    rules.no_vllm(spec)
    rules.trl_step(spec, NAME)


def note(spec) -> str:
    return rules.worst_case(spec)
