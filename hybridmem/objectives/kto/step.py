"""TRL's `KTOTrainer` step: the KL batch under no_grad, the completions, the reference's
log-probs (full logits, and the fused head of trl >= 1.15).

Op for op as the trainer runs it (sources per function; `objectives.steps` says how the
trace runs a step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmem import objectives
from hybridmem.objectives.steps import (
    REFERENCE, batch_logps, ones, padded_mask, part, reference_context, with_precomputed,
)


def _kto_kl_logps(model, batch) -> torch.Tensor:
    """KTOTrainer `_compute_kl_logps` (trl 1.16): the KL batch's fused log-probs, no_grad."""
    labels = batch["KL_input_ids"].masked_fill(batch["KL_completion_mask"] == 0, -100)
    with torch.no_grad():
        logps = model(input_ids=batch["KL_input_ids"], attention_mask=batch["KL_attention_mask"],
                      use_cache=False, labels=labels, fused_lm_head=True).log_probs
    return logps[:, -(labels.size(1) - 1):].sum(-1)


def kto_fused_loss(job, spec) -> torch.Tensor:
    """KTOTrainer `_compute_loss` (trl 1.16 kto_trainer.py, loss_type "kto"): the policy's KL
    log-probs (no_grad), its fused forward on the completions, the desirable / undesirable
    split by `index_select` (the indices `nonzero` makes from the labels: alternating here),
    the reference's KL and completion log-probs under no_grad (or the batch's precomputed
    ones), the loss; then the metrics on the per-token outputs (boolean-mask reads as masked
    products, after the forward's high point)."""
    batch, n = job.batch, spec.micro_batch
    device = batch["input_ids"].device
    kl_logps = _kto_kl_logps(job.model, batch)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    outputs = job.model(**inputs, use_cache=False, labels=labels, fused_lm_head=True)
    seq_len = batch["input_ids"].size(1) - 1
    logps = outputs.log_probs[:, -seq_len:].sum(-1)
    chosen_idx = torch.arange(0, n, 2, device=device)  # `torch.nonzero(bool_labels)`
    rejected_idx = torch.arange(1, n, 2, device=device)
    chosen, rejected = logps.index_select(0, chosen_idx), logps.index_select(0, rejected_idx)
    if objectives.ref_model_of(spec) == "precomputed":
        ref = batch["ref_logps"]
        ref_kl = batch["ref_KL_logps"]
    else:
        model, ctx = reference_context(job, spec)
        with part(job, REFERENCE), torch.no_grad(), ctx:
            ref_kl = _kto_kl_logps(model, batch)
            ref_out = model(**inputs, use_cache=False, labels=labels, fused_lm_head=True)
            ref = ref_out.log_probs[:, -seq_len:].sum(-1)
            del ref_out
    ref_chosen, ref_rejected = ref.index_select(0, chosen_idx), ref.index_select(0, rejected_idx)
    beta = objectives.beta_of(spec)
    kl = (kl_logps - ref_kl).mean().detach().mean().clamp(min=0)
    chosen_losses = 1 - F.sigmoid(beta * ((chosen - ref_chosen) - kl))
    rejected_losses = 1 - F.sigmoid(beta * (kl - (rejected - ref_rejected)))
    losses = torch.cat((1.0 * chosen_losses, 1.0 * rejected_losses), 0)
    with torch.no_grad():  # the metrics
        mask = batch["completion_mask"][:, 1:]
        (outputs.entropy[:, -seq_len:].detach() * mask).sum()
        batch["attention_mask"].sum()
        mean_logits = outputs.mean_logits[:, -seq_len:]
        for idx in (chosen_idx, rejected_idx):
            (mean_logits.index_select(0, idx) * mask.index_select(0, idx).bool()).sum()
    return losses.nanmean()


def kto_forward(job, model, spec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """trl/trainer/kto_trainer.py `forward`: the KL batch's log-probs under no_grad
    (`_compute_kl_logps`), then the completions' forward, their log-probs, and the desirable /
    undesirable split by index (copies of the logits' rows, kept as the metrics read them)."""
    batch = job.batch
    with torch.no_grad():
        kl_logits = model(batch["kl_input_ids"], use_cache=False).logits
        kl_logps = batch_logps(kl_logits, batch["kl_labels"], average=False)
        del kl_logits
    logits = model(batch["input_ids"], use_cache=False).logits
    logps = batch_logps(logits, batch["labels"], average=False)
    n = spec.micro_batch
    chosen_idx = list(range(0, n, 2))  # alternating desirable / undesirable labels
    rejected_idx = list(range(1, n, 2))
    chosen_logps, rejected_logps = logps[chosen_idx, ...], logps[rejected_idx, ...]
    chosen_logits, rejected_logits = logits[chosen_idx, ...], logits[rejected_idx, ...]
    return chosen_logps, rejected_logps, kl_logps, chosen_logits.sum() + rejected_logits.sum()


def kto_loss(job, spec) -> torch.Tensor:
    """`get_batch_loss_metrics`: the policy's `forward`, the reference's (no_grad; or the
    batch's precomputed log-probs), then `kto_loss` (sigmoid of the KL-shifted log-ratios)."""
    chosen, rejected, kl, _ = kto_forward(job, job.model, spec)
    if objectives.ref_model_of(spec) == "precomputed":
        ref_chosen, ref_rejected, ref_kl = (job.batch["ref_chosen_logps"],
                                            job.batch["ref_rejected_logps"],
                                            job.batch["ref_kl_logps"])
    else:
        model, ctx = reference_context(job, spec)
        with part(job, REFERENCE), torch.no_grad(), ctx:
            ref_chosen, ref_rejected, ref_kl, _ = kto_forward(job, model, spec)
    beta = objectives.beta_of(spec)
    kl_term = (kl - ref_kl).mean().clamp(min=0).detach()
    losses = torch.cat((1 - F.sigmoid(beta * ((chosen - ref_chosen) - kl_term)),
                        1 - F.sigmoid(beta * (kl_term - (rejected - ref_rejected)))), 0)
    return losses.nanmean()


def batch(spec, device=None, fused: bool = False) -> dict:
    """The completions' ids and labels (-100 on the prompt), the KL batch's; at a TRL with the
    fused head KTOTrainer's collator (trl >= 1.15): the masks, the KL batch's, the desirable
    labels. Precomputed reference log-probs: per sequence, the completions' and the KL
    batch's."""
    n, s, prompt = spec.micro_batch, spec.seq_len, objectives.prompt_length(spec)
    ids = ones(n, s, device)
    labels = ones(n, s, device, prompt, fill=-100)
    out = {"input_ids": ids, "labels": labels, "kl_input_ids": ones(n, s, device)}
    out["kl_labels"] = labels.clone()
    if not fused:
        return with_precomputed(out, spec, ("ref_chosen_logps", "ref_rejected_logps",
                                            "ref_kl_logps"), device)
    completion = ones(n, s, device, prompt, fill=0)
    out = {"input_ids": ids, "attention_mask": padded_mask(ids),
           "completion_mask": completion, "KL_input_ids": out["kl_input_ids"],
           "KL_attention_mask": padded_mask(ids), "KL_completion_mask": completion.clone(),
           "label": torch.arange(n, device=device) % 2 == 0}
    return with_precomputed(out, spec, ("ref_logps", "ref_KL_logps"), device)


def loss(job, spec, micro: int = 0) -> torch.Tensor:
    return (kto_fused_loss if job.fused else kto_loss)(job, spec)
