"""TRL's `RewardTrainer` step: the scalar rewards of the concatenated batch.

Op for op as the trainer runs it (sources per function; `objectives.steps` says how the
trace runs a step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmem import objectives
from hybridmem.objectives.steps import ones, padded_mask



def rm_loss(job, spec) -> torch.Tensor:
    """trl/trainer/reward_trainer.py `compute_loss`: the scalar rewards of the concatenated
    chosen + rejected batch (`AutoModelForSequenceClassification`, num_labels=1: the score of
    each sequence's last token), `-logsigmoid(chosen - rejected).mean()`."""
    half = spec.micro_batch
    rewards = job.model(input_ids=job.batch["input_ids"],
                        attention_mask=job.batch.get("attention_mask"), use_cache=False).logits
    return -F.logsigmoid(rewards[:half] - rewards[half:]).mean()


def batch(spec, device=None, fused: bool = False) -> dict:
    """The concatenated ids and the collator's attention mask (`PADDED`)."""
    ids = ones(objectives.rows(spec), spec.seq_len, device)
    return {"input_ids": ids, "attention_mask": padded_mask(ids)}


def loss(job, spec, micro: int = 0) -> torch.Tensor:
    return rm_loss(job, spec)
