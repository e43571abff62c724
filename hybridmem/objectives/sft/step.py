"""TRL's `SFTTrainer` step through its fused LM head (trl >= 1.15); transformers'
`Trainer` runs the plain causal-LM loss (`trace.runner`).

Op for op as the trainer runs it (sources per function; `objectives.steps` says how the
trace runs a step)."""

from __future__ import annotations

import torch

from hybridmem.objectives.steps import padded_mask


def sft_trl_loss(job, spec) -> torch.Tensor:
    """`SFTTrainer.compute_loss` (trl 1.16 sft_trainer.py, loss_type "nll"): the fused
    forward's per-token log-probs, `-log_probs`, its sum over `num_items_in_batch` (the
    Trainer loop's token count, a batch input), times the processes under
    `average_tokens_across_devices`; then the metrics: the label mask's count,
    the entropy's and the top-1's sums (their `.item()` reads make nothing on a device) and
    the attention mask's count. The output object dies when compute_loss returns."""
    batch = job.batch
    inputs = {k: v for k, v in batch.items() if k != "num_items_in_batch"}
    outputs = job.model(**inputs, use_cache=False, fused_lm_head=True)
    per_token_loss = -outputs.log_probs
    loss = per_token_loss.sum() / torch.as_tensor(batch["num_items_in_batch"]).clamp(min=1)
    del per_token_loss
    if _average_tokens_across_devices():  # `loss * (num_processes // tp_size)`: one GPU, a copy
        loss = loss * 1
    num_valid = outputs.label_mask.sum().sum()
    (outputs.entropy.detach().sum().sum() / num_valid)
    (outputs.is_top1.sum().sum() / num_valid)
    batch["attention_mask"].sum().sum()
    return loss


def _average_tokens_across_devices() -> bool:
    """The installed transformers' `TrainingArguments.average_tokens_across_devices` default
    (True in 5.x), which SFTTrainer reads when the loop passes `num_items_in_batch`."""
    from dataclasses import fields

    from transformers import TrainingArguments

    return next(f.default for f in fields(TrainingArguments)
                if f.name == "average_tokens_across_devices")


def sft_trl_batch(batch: dict) -> dict:
    """TRL's `DataCollatorForLanguageModeling` batch (trl 1.16 sft_trainer.py): input_ids,
    labels and a padded batch's attention mask (int64, `padded_mask`), with the loop's
    `num_items_in_batch` (`Trainer._get_num_items_in_batch`: the count of labels not -100
    over the parallel degrees, a true division: a 0-dim fp32 tensor)."""
    ids = batch["input_ids"]
    return {**batch, "attention_mask": padded_mask(ids),
            "num_items_in_batch": torch.zeros((), device=ids.device)}


def collate(batch: dict) -> dict:
    return sft_trl_batch(batch)


def loss(job, spec, micro: int = 0) -> torch.Tensor:
    """TRL's SFTTrainer through its fused head (transformers' Trainer runs `model(**batch)`)."""
    return sft_trl_loss(job, spec)
