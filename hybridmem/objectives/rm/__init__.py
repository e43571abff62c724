"""Reward model (TRL `RewardTrainer`): an `AutoModelForSequenceClassification` with
`num_labels=1` (a scalar `score` head, no vocabulary logits), chosen and rejected concatenated
(`step.py`)."""

from __future__ import annotations

from hybridmem.objectives import rules

NAME = "rm"
ORDER = 4
HEAD = "score"  # num_labels=1: the (1, hidden) score
CONCATENATED = True
# trl 1.16 reward_trainer.py `DataCollatorForPreference`: padded to the longest
PADDED = True
# DEFAULT_BETA 0 (RewardConfig has no beta), FUSED_OUTPUTS None (a score head: no log-probs),
# BATCH_COLUMNS 0 (the attention mask takes the labels' place): the protocol's defaults
# its trainer's `loss_is_scaled_for_ga = False` (trl 1.16 trl/trainer/reward_trainer.py:330):
# transformers' loop divides the loss at every step (`objectives.loop_divisions`)
UNSCALED_LOSS = True


def check(spec) -> None:
    rules.no_reference(spec, NAME)
    rules.no_vllm(spec)
    rules.trl_step(spec, NAME)


def note(spec) -> str:
    return rules.worst_case(spec, prompt=False)
