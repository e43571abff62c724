"""TRL's `GRPOTrainer` step: the generation phase once per optimizer step, then the
clipped surrogate per micro-step (full logits, and the fused head of trl >= 1.15).

Op for op as the trainer runs it (sources per function; `objectives.steps` says how the
trace runs a step)."""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F

from hybridmem import objectives
from hybridmem.objectives.grpo import completion_length, old_logps
from hybridmem.objectives.steps import (
    GENERATION, REFERENCE, entropy_from_logits, padded_mask, part, reference_context,
    ones, selective_log_softmax,
)


def grpo_logps(model, input_ids: torch.Tensor, keep: int, batch_size: int,
               entropy: bool = False) -> torch.Tensor:
    """grpo_trainer.py `_get_per_token_logps_and_entropies`: chunks of `batch_size` sequences,
    `logits_to_keep = keep + 1`, the completion's logits / temperature (1.0: a copy), their
    `selective_log_softmax`; with `entropy` the per-token entropy under no_grad."""
    out = []
    for start in range(0, input_ids.size(0), batch_size):
        ids = input_ids[start:start + batch_size]
        logits = model(input_ids=ids, logits_to_keep=keep + 1, use_cache=False).logits
        logits = logits[:, :-1, :][:, -keep:, :]
        logits = logits / 1.0  # GRPOConfig temperature (default 1.0): a new tensor
        out.append(selective_log_softmax(logits, ids[:, -keep:]))
        if entropy:
            with torch.no_grad():
                entropy_from_logits(logits)
        del logits
    return torch.cat(out, dim=0)


def generate(model, prompt_ids: torch.Tensor, new_tokens: int, every_step: bool = False
             ) -> torch.Tensor:
    """transformers `GenerationMixin._sample` as TRL's `generate` call runs it (no_grad,
    `disable_compile=True`): a DynamicCache, the prefill with `logits_to_keep=1`, then one token
    at a time: the last logits copied to fp32, softmax, `multinomial`, the ids concatenated;
    every step grows each layer's K and V by `torch.cat` (cache_utils.py `DynamicLayer.update`).
    All `new_tokens` steps count (no sequence stops early: the bound TRL pads to).

    The steps between the prefill and the last one make the same tensors each, one token
    smaller: the cache and the ids only grow, so the last step is the loop's high point. Unless
    `every_step`, they are skipped by growing each layer's K, V and the ids to the sizes the
    loop leaves them at before its last step (a new tensor beside the old one, as `cat`
    makes it); tests/test_objectives.py checks the allocated peak equals the full loop's."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids, step = prompt_ids, prompt_ids
    for n in range(new_tokens):
        if n == 1 and new_tokens > 2 and not every_step:  # to the loop's last step
            # before step m's forward the cache holds P + m - 1 tokens and the ids P + m:
            # step 1 becomes step new_tokens - 2, the one before the last
            jump = new_tokens - 3
            for layer in cache.layers:
                layer.keys = _grown(layer.keys, jump)
                layer.values = _grown(layer.values, jump)
            ids = _grown(ids, jump, dim=-1)
        elif 1 < n < new_tokens - 1 and not every_step:
            continue
        with warnings.catch_warnings():  # transformers 5.x renames past_key_values: same cache
            warnings.simplefilter("ignore", FutureWarning)
            logits = model(input_ids=step, past_key_values=cache, use_cache=True,
                           logits_to_keep=1).logits
        scores = logits[:, -1, :].to(copy=True, dtype=torch.float32)
        del logits
        probs = F.softmax(scores, dim=-1)
        del scores
        # torch.multinomial(probs, 1): ATen's one-sample path (Distributions.cpp
        # `multinomial`): q = empty_like(probs).exponential_(); div_out(q, probs, q); argmax
        q = torch.empty_like(probs).exponential_(1)
        torch.div(probs, q, out=q)
        del probs
        step = q.argmax(dim=-1, keepdim=True)
        del q
        ids = torch.cat([ids, step], dim=-1)
    del cache
    return ids


def _grown(t: torch.Tensor, extra: int, dim: int = -2) -> torch.Tensor:
    """`t` with `extra` more positions along `dim` (a new tensor, zeros: token ids stay valid
    on a real run)."""
    shape = list(t.shape)
    shape[dim] += extra
    return t.new_zeros(shape)


def grpo_prepare(job, spec, every_step: bool = False, autocast=contextlib.nullcontext) -> None:
    """`_generate_and_score_completions`, once per optimizer step for `micro_batch x
    grad_accum` sequences (steps_per_generation = gradient_accumulation_steps): outside the
    loss's autocast (it runs in `_prepare_inputs`), the generation, then under no_grad the
    reference's per-token log-probs when beta > 0. Its outputs (ids, masks, reference
    log-probs, advantages) are the step's inputs, alive until the step ends. `every_step`:
    `generate`'s full loop (the CUDA harness measures it). `autocast`: the loss's autocast
    context, which GRPOTrainer enters around each fused log-prob forward (trl >= 1.15)."""
    seqs = spec.micro_batch * spec.grad_accum
    completion = completion_length(spec)
    prompt_ids = torch.ones(seqs, spec.seq_len - completion, dtype=torch.long,
                            device=job.batch["input_ids"].device)
    with part(job, GENERATION), torch.no_grad():
        ids = generate(job.model, prompt_ids, completion, every_step)
    del prompt_ids
    job.generated = True
    if job.fused:
        _grpo_fused_prepare(job, spec, ids, completion, autocast)
        return
    job.grpo = {"ids": ids, "advantages": torch.zeros(seqs, device=ids.device)}
    if objectives.ref_model_of(spec) != "none":
        model, ctx = reference_context(job, spec)
        with part(job, REFERENCE), torch.no_grad(), ctx:
            job.grpo["ref"] = grpo_logps(model, ids, completion, spec.micro_batch)


def grpo_fused_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int,
                     batch_size: int, entropy: bool = False) -> torch.Tensor:
    """GRPOTrainer `_get_per_token_logps_and_entropies` (trl 1.16): chunks of `batch_size`
    sequences, labels -100 off the completion's last `keep` positions and the padding, the
    fused forward (`add_fused_lm_head(outputs=("log_probs", "entropy"))`: both computed
    whatever is asked), the last `keep` log-probs (and entropies) of each chunk, each list's
    `torch.cat` (a copy)."""
    logps, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-keep] = -100
        outputs = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        logps.append(outputs.log_probs[:, -keep:])
        if entropy:
            entropies.append(outputs.entropy[:, -keep:])
        del outputs, labels
    out = torch.cat(logps, dim=0)
    if entropy:
        torch.cat(entropies, dim=0)  # `entropies`: read by the metrics, dead after the loss
    return out


def _grpo_fused_prepare(job, spec, ids: torch.Tensor, completion: int, autocast) -> None:
    """`_generate_and_score_completions` (trl 1.16) after the generation: the prompt and
    completion ids and masks (the completion's a padded one, `padded_mask`: a sequence that
    stops early is the case that builds the attention masks), then under no_grad the old
    policy's log-probs when `objective.old_logps` (num_iterations > 1) and the reference's
    when beta > 0, each under the loss's `autocast` (grpo_trainer.py
    `_get_per_token_logps_and_entropies`: `with self.accelerator.autocast()`); advantages
    per sequence. All alive until the step ends (the buffer)."""
    seqs, prompt = ids.size(0), ids.size(1) - completion
    grpo = {"prompt_ids": ids[:, :prompt].clone(), "completion_ids": ids[:, prompt:].clone()}
    del ids
    grpo["prompt_mask"] = torch.ones_like(grpo["prompt_ids"])
    grpo["completion_mask"] = padded_mask(grpo["completion_ids"])
    # `num_items_in_batch = accelerator.gather(loss_mask.sum()).sum()`: a 0-dim int64 the
    # buffer keeps through the step (grpo_trainer.py `_generate_and_score_completions`)
    grpo["num_items_in_batch"] = grpo["completion_mask"].sum().sum()
    job.grpo = grpo
    full = torch.cat([grpo["prompt_ids"], grpo["completion_ids"]], dim=1)
    mask = torch.cat([grpo["prompt_mask"], grpo["completion_mask"]], dim=1)
    with torch.no_grad(), autocast():
        if old_logps(spec):
            with part(job, GENERATION):
                grpo["old"] = grpo_fused_logps(job.model, full, mask, completion,
                                               spec.micro_batch)
        if objectives.ref_model_of(spec) != "none":
            model, ctx = reference_context(job, spec)
            with part(job, REFERENCE), ctx:
                grpo["ref"] = grpo_fused_logps(model, full, mask, completion, spec.micro_batch)
    del full, mask
    grpo["advantages"] = torch.zeros(seqs, device=grpo["prompt_ids"].device)


def grpo_fused_loss(job, spec, micro: int) -> torch.Tensor:
    """GRPOTrainer `_compute_loss` (trl 1.16, loss_type "dapo", token-level importance
    sampling) on micro-step `micro`'s slice: the prompt and completion concatenated, the fused
    log-probs and entropies, the ratio against the old policy's log-probs (the detached
    current ones at num_iterations 1), the clipped surrogate, the KL when beta > 0, the
    masked sum over `num_items_in_batch`."""
    n, keep = spec.micro_batch, completion_length(spec)
    # `split_tensor_dict`: a 0-dim tensor goes whole into every slice
    part_of = {k: v[micro * n:(micro + 1) * n] if v.dim() else v for k, v in job.grpo.items()}
    input_ids = torch.cat([part_of["prompt_ids"], part_of["completion_ids"]], dim=1)
    attention_mask = torch.cat([part_of["prompt_mask"], part_of["completion_mask"]], dim=1)
    mask = part_of["completion_mask"]
    logps = grpo_fused_logps(job.model, input_ids, attention_mask, keep, n, entropy=True)
    advantages = part_of["advantages"].unsqueeze(1)
    old = part_of.get("old", logps.detach())
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)  # GRPOConfig epsilon 0.2 (epsilon_high too)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if "ref" in part_of:
        ref = part_of["ref"]
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        per_token_loss = per_token_loss + objectives.beta_of(spec) * kl
    # "dapo": `num_items_in_batch.clamp(min=1.0) / num_processes`, rescaled by
    # accumulation steps / steps_per_generation (equal by default: a factor 1)
    normalizer = part_of["num_items_in_batch"].clamp(min=1.0) / 1
    return (per_token_loss * mask).sum() / normalizer


def grpo_loss(job, spec, micro: int) -> torch.Tensor:
    """grpo_trainer.py `_compute_loss` on micro-step `micro`'s slice: the policy's per-token
    log-probs (entropy under no_grad), the clipped importance ratio against the detached
    log-probs (old = current: num_iterations 1), the KL to the reference when beta > 0, the
    masked token mean."""
    n, completion = spec.micro_batch, completion_length(spec)
    ids = job.grpo["ids"][micro * n:(micro + 1) * n]
    logps = grpo_logps(job.model, ids, completion, n, entropy=True)
    advantages = job.grpo["advantages"][micro * n:(micro + 1) * n]
    coef_1 = torch.exp(logps - logps.detach())
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)  # GRPOConfig epsilon 0.2
    per_token_loss = -torch.min(coef_1 * advantages.unsqueeze(1),
                                coef_2 * advantages.unsqueeze(1))
    if "ref" in job.grpo:
        ref = job.grpo["ref"][micro * n:(micro + 1) * n]
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        per_token_loss = per_token_loss + objectives.beta_of(spec) * kl
    return per_token_loss.sum() / per_token_loss.numel()


def batch(spec, device=None, fused: bool = False) -> dict:
    """A stand-in batch of ids: the generation makes the step's (`prepare`)."""
    return {"input_ids": ones(objectives.rows(spec), spec.seq_len, device)}


def prepare(job, spec, every_step: bool = False, autocast=None) -> None:
    grpo_prepare(job, spec, every_step, autocast or contextlib.nullcontext)


def loss(job, spec, micro: int = 0) -> torch.Tensor:
    return (grpo_fused_loss if job.fused else grpo_loss)(job, spec, micro)
