"""TRL's `DPOTrainer` step: the concatenated forward, the reference's log-probs, the
sigmoid loss (full logits, and the fused head of trl >= 1.15).

Op for op as the trainer runs it (sources per function; `objectives.steps` says how the
trace runs a step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmem import objectives
from hybridmem.objectives.steps import (
    REFERENCE, ones, padded_mask, part, positions, reference_context, selective_log_softmax,
    with_precomputed,
)


def dpo_forward(model, batch: dict, half: int, prompt: int) -> dict:
    """trl/trainer/dpo_trainer.py `concatenated_forward` (TRL 0.19-0.2x): one forward of the
    concatenated batch, the shifted per-token log-probs, their sums per sequence, and the
    mean-logits metrics (a copy of each half's completion logits)."""
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    logits = model(input_ids, use_cache=False).logits
    labels = torch.roll(input_ids, shifts=-1, dims=1)
    loss_mask = torch.roll(loss_mask, shifts=-1, dims=1).bool()
    labels.masked_fill_(~loss_mask, 0)
    per_token_logps = selective_log_softmax(logits, labels)
    per_token_logps = per_token_logps.masked_fill(~loss_mask, 0)
    per_token_logps = torch.roll(per_token_logps, shifts=1, dims=1)
    all_logps = per_token_logps[:, 1:].sum(-1)
    seq = input_ids.shape[1]
    out = {"chosen_logps": all_logps[:half], "rejected_logps": all_logps[half:]}
    # loss_mask rolled left: true on the completion's tokens shifted by one (the last row
    # position wraps to the first, which the prompt masks out)
    rows, cols = positions(half, max(prompt - 1, 0), seq - 1, input_ids.device)
    out["mean_chosen_logits"] = logits[:half][rows, cols].mean()
    out["mean_rejected_logits"] = logits[half:][rows, cols].mean()
    return out


def dpo_loss(job, spec) -> torch.Tensor:
    """`get_batch_loss_metrics`: the policy's concatenated forward, then the reference's log
    probs (`compute_ref_log_probs`: no_grad; or the batch's precomputed ones), then the
    sigmoid loss (`dpo_loss`, loss_type "sigmoid")."""
    half, prompt = spec.micro_batch, objectives.prompt_length(spec)
    policy = dpo_forward(job.model, job.batch, half, prompt)
    if objectives.ref_model_of(spec) == "precomputed":
        ref_chosen, ref_rejected = job.batch["ref_chosen_logps"], job.batch["ref_rejected_logps"]
    else:
        model, ctx = reference_context(job, spec)
        with part(job, REFERENCE), torch.no_grad(), ctx:
            ref = dpo_forward(model, job.batch, half, prompt)
        ref_chosen, ref_rejected = ref["chosen_logps"], ref["rejected_logps"]
    beta = objectives.beta_of(spec)
    logratios = policy["chosen_logps"] - policy["rejected_logps"]
    ref_logratios = ref_chosen - ref_rejected
    losses = -F.logsigmoid(beta * (logratios - ref_logratios))
    return losses.mean()


def dpo_fused_loss(job, spec) -> torch.Tensor:
    """DPOTrainer `_compute_loss` (trl 1.16 dpo_trainer.py, loss_type "sigmoid", reverse KL):
    labels are the ids with -100 off the completion; the policy's fused forward
    (`add_fused_lm_head` with `DPO_FUSED_OUTPUTS`); the per-token log-probs summed per
    sequence; the reference's the same way under no_grad (its own fused head, log-probs
    only; or the batch's precomputed ones); the loss; then the metrics on the per-token
    outputs. Boolean-mask reads of the metrics (`chosen_mean_logits[chosen_mask.bool()]`)
    are masked products here: (rows x seq) vectors in the forward, after its high point."""
    batch = job.batch
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    completion_mask = batch["completion_mask"]
    shift_mask = completion_mask[..., 1:]
    labels = batch["input_ids"].masked_fill(completion_mask == 0, -100)
    outputs = job.model(**inputs, use_cache=False, labels=labels, fused_lm_head=True)
    seq_len = shift_mask.size(1)
    logps = outputs.log_probs[:, -seq_len:].sum(dim=1)
    chosen, rejected = logps.chunk(2, dim=0)
    if objectives.ref_model_of(spec) == "precomputed":
        ref_chosen, ref_rejected = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
    else:
        model, ctx = reference_context(job, spec)
        with part(job, REFERENCE), torch.no_grad(), ctx:
            ref = model(**inputs, use_cache=False, labels=labels, fused_lm_head=True)
            ref_logps = ref.log_probs[:, -seq_len:].sum(dim=1)
            del ref
        ref_chosen, ref_rejected = ref_logps.chunk(2, dim=0)
    chosen_ratios, rejected_ratios = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratios - rejected_ratios
    loss = 0.0 + (-F.logsigmoid(objectives.beta_of(spec) * delta)).mean() * 1.0
    with torch.no_grad():  # the metrics (their `.item()` reads make nothing on a device)
        (outputs.entropy[:, -seq_len:].detach() * shift_mask).sum()
        shift_mask.sum()
        batch["attention_mask"].sum()
        chosen_mask, rejected_mask = shift_mask.chunk(2, dim=0)
        for logits, m in zip(outputs.mean_logits[:, -seq_len:].chunk(2, dim=0),
                             (chosen_mask, rejected_mask)):
            (logits * m.bool()).sum()
        (outputs.is_top1[:, -seq_len:].chunk(2, dim=0)[0] & chosen_mask.bool()).sum()
    return loss


def batch(spec, device=None, fused: bool = False) -> dict:
    """The concatenated ids and the loss mask (prompt tokens out); at a TRL with the fused head
    `DataCollatorForPreference` (trl >= 1.15): the attention and completion masks. Precomputed
    reference log-probs: per sequence, chosen and rejected."""
    rows, s = objectives.rows(spec), spec.seq_len
    ids = ones(rows, s, device)
    mask = ones(rows, s, device, objectives.prompt_length(spec), fill=0)
    out = {"input_ids": ids, "loss_mask": mask}
    if fused:
        out = {"input_ids": ids, "attention_mask": padded_mask(ids), "completion_mask": mask}
    return with_precomputed(out, spec, ("ref_chosen_logps", "ref_rejected_logps"), device)


def loss(job, spec, micro: int = 0) -> torch.Tensor:
    return (dpo_fused_loss if job.fused else dpo_loss)(job, spec)
