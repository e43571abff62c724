"""TRL's `ORPOTrainer` step: the concatenated forward, the chosen NLL and the odds-ratio
term; no reference.

Op for op as the trainer runs it (sources per function; `objectives.steps` says how the
trace runs a step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmem import objectives
from hybridmem.objectives.steps import batch_logps, ones, padded_mask


def orpo_loss(job, spec) -> torch.Tensor:
    """trl/trainer/orpo_trainer.py `concatenated_forward` + `odds_ratio_loss`: the NLL of the
    chosen half (`logits[..., :-1, :].contiguous()` into CrossEntropyLoss), the averaged
    log-probs of both halves, the log-odds-ratio term (beta)."""
    half = spec.micro_batch
    logits = job.model(job.batch["input_ids"], attention_mask=job.batch.get("attention_mask"),
                       use_cache=False).logits
    labels = job.batch["labels"]
    chosen = logits[:half][..., :-1, :].contiguous()
    nll = F.cross_entropy(chosen.view(-1, chosen.shape[-1]),
                          labels[:half][..., 1:].contiguous().view(-1))
    del chosen
    all_logps = batch_logps(logits, labels, average=True)
    chosen_logps, rejected_logps = all_logps[:half], all_logps[half:]
    log_odds = (chosen_logps - rejected_logps) - (
        torch.log1p(-torch.exp(chosen_logps)) - torch.log1p(-torch.exp(rejected_logps)))
    ratio = F.logsigmoid(log_odds)
    return nll - (objectives.beta_of(spec) * ratio).mean()


def batch(spec, device=None, fused: bool = False) -> dict:
    """The concatenated ids, the collator's attention mask (`PADDED`) and the labels (-100 on
    the prompt)."""
    rows, s = objectives.rows(spec), spec.seq_len
    ids = ones(rows, s, device)
    return {"input_ids": ids, "attention_mask": padded_mask(ids),
            "labels": ones(rows, s, device, objectives.prompt_length(spec), fill=-100)}


def loss(job, spec, micro: int = 0) -> torch.Tensor:
    return orpo_loss(job, spec)
