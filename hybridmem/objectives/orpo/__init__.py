"""ORPO (TRL `ORPOTrainer`): the concatenated policy forward (2 x micro_batch sequences), no
reference; the SFT NLL on the chosen half beside the odds-ratio term (`step.py`)."""

from __future__ import annotations

from hybridmem.objectives import rules

NAME = "orpo"
ORDER = 2
HEAD = "logps_nll"
CONCATENATED = True
# trl/experimental/orpo `DPODataCollatorWithPadding`: chosen and rejected padded to the longest
PADDED = True
DEFAULT_BETA = 0.1  # trl/trainer/orpo_config.py
# FUSED_OUTPUTS None (the default): ORPOTrainer has no fused head (trl 1.16)
BATCH_COLUMNS = 1  # the collator's attention mask beside ids and labels
# its trainer's `loss_is_scaled_for_ga = False` (trl 1.16 trl/experimental/orpo/orpo_trainer.py:132):
# transformers' loop divides the loss at every step (`objectives.loop_divisions`)
UNSCALED_LOSS = True
# prompt_length 0 (the default): `max_prompt_length` only bounds the prompt (TRL truncates
# to it), the worst case


def check(spec) -> None:
    rules.no_reference(spec, NAME)
    rules.no_vllm(spec)
    rules.trl_step(spec, NAME)


def note(spec) -> str:
    return rules.worst_case(spec)
