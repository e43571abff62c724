"""The training step of the objectives beyond SFT (`hybridmem.job.objective`), as TRL runs it.

Each function is the memory-relevant code path of its trainer, op for op (sources per
function); the runner calls `loss(job, spec)` in place of `model(**batch).loss` inside the
forward's autocast region, as Trainer's `compute_loss_context_manager` covers `compute_loss`.
Deviations, each the same bytes: boolean-mask writes (`labels[~mask] = 0`) are `masked_fill_`
(in place, no data-dependent shape under fake / meta tensors), boolean-mask reads
(`logits[mask]`) index with the mask's positions built from its known shape (the same (n, V)
copy and saved index vectors), and no attention mask is passed (an unpadded batch, as the SFT
batch of `trace.inputs`). Tensors the reference's forward makes are relabelled to the part
"reference", the generation's to "generation" (`Prediction.modules`, docs/objectives.md).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F

from hybridmem.job import objective as rules

REFERENCE = "reference"
GENERATION = "generation"


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """trl/trainer/utils.py `selective_log_softmax`, line for line: fp32 logits take the gather
    and a per-row logsumexp; others a per-row log_softmax (the row's (S, V) output saved)."""
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
        lse = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
        return selected - lse
    out = []
    for row_logits, row_labels in zip(logits, index):
        row_logps = F.log_softmax(row_logits, dim=-1)
        out.append(row_logps.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(out)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 1) -> torch.Tensor:
    """trl/trainer/utils.py `entropy_from_logits` (chunk_size 1: one sequence at a time)."""
    out = []
    for chunk in logits.split(chunk_size, dim=0):
        logps = F.log_softmax(chunk, dim=-1)
        out.extend(-(torch.exp(logps) * logps).sum(-1))
    return torch.stack(out)


def _positions(rows: int, start: int, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, column) positions of a mask that is true from column `start` on in every row:
    what `logits[mask]` indexes with (`mask.nonzero()`), built without reading the mask."""
    cols = torch.arange(start, seq, device=device)
    return (torch.arange(rows, device=device).repeat_interleave(seq - start),
            cols.repeat(rows))


@contextlib.contextmanager
def part(job, name: str):
    """Tensors made inside the block belong to part `name` (the reference, the generation)."""
    tracker = job.tracker
    first = len(tracker.storages) if tracker is not None else 0
    try:
        yield
    finally:
        if tracker is not None:
            for st in tracker.storages[first:]:
                st.part = name


def reference_context(job, spec):
    """The reference forward's model and context: the frozen copy, or the policy with its
    adapters disabled (peft `PeftModel.disable_adapter()`, TRL's `null_ref_context`)."""
    if rules.ref_model_of(spec) == "adapter":
        return job.model, job.model.disable_adapter()
    return job.ref, contextlib.nullcontext()


# ---------------------------------------------------------------- TRL's fused LM head

# Which fold of the fused head's tiles the trace runs: "triton" (what TRL runs on a CUDA GPU:
# `_use_triton(device)` is true where Triton is installed, which torch's Linux CUDA wheels
# ship) or "torch" (the torch fold TRL runs without Triton: a CPU run, the oracle tests')
HEAD_PATHS = ("triton", "torch")
_head = {"path": "triton"}


@contextlib.contextmanager
def head_path(path: str):
    """Trace the fused head's `path` (`HEAD_PATHS`) inside the block."""
    if path not in HEAD_PATHS:
        raise ValueError(f"head_path: {path!r}, valid: {HEAD_PATHS}")
    saved, _head["path"] = _head["path"], path
    try:
        yield
    finally:
        _head["path"] = saved


def add_fused_head(model, spec) -> None:
    """What `SFTTrainer.__init__` does after `Trainer.__init__` (trl 1.16 sft_trainer.py):
    TRL's own `add_fused_lm_head` on the PEFT-unwrapped model, `outputs=("log_probs",
    "entropy", "is_top1")` (`objective.FUSED_OUTPUTS`: DPOTrainer's and KTOTrainer's ask
    for "mean_logits" too). Its forward then runs TRL's
    `_ChunkedLogProbFunction` (trl/kernels/chunked_logprob.py): the head in tiles of
    `TOKEN_CHUNK_SIZE` (4096) tokens x 32,768 vocabulary entries, fp32 accumulators."""
    from trl.trainer.utils import add_fused_lm_head

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, outputs=rules.FUSED_OUTPUTS[spec.objective])


def add_fused_reference_head(ref) -> None:
    """DPOTrainer's / KTOTrainer's `add_fused_lm_head(self.ref_model)` on a separate
    reference: log-probs only (its default `outputs`)."""
    from trl.trainer.utils import add_fused_lm_head

    if ref is not None:
        add_fused_lm_head(ref)


@contextlib.contextmanager
def _triton_fold():
    """The Triton path's allocations in place of the torch fold's: `_forward_kernel` and
    `_backward_kernel` (chunked_logprob.py) read the (tokens x vocab) tile and write the
    running fp32 statistics, or the gradient into the tile, in place: no tensor of their
    own; `_addmm_fp32` on CUDA is `torch.addmm(acc, a, b, out_dtype=torch.float32,
    out=acc)`: no fp32 copies of its operands. Values are not needed (fake / meta tensors),
    so each becomes a call that makes nothing. The wrapper's own tensors (the fp32
    accumulators, the tile buffer `mm_buf`, `grad_hidden` / `grad_weight`, the casts) are
    TRL's code, run as is. Not emulated: on Triton devices `add_fused_lm_head` scores only
    the valid positions (`hidden_states[mask]`, a data-dependent shape), the torch fold every
    position; with every label valid (the priced batch) the tiles are the same size, and
    the outputs' scatter differs by a few (batch x seq) vectors."""
    from trl.kernels import chunked_logprob as kernel

    def nothing(*args, **kwargs) -> None:
        return None

    saved = kernel._forward_tile, kernel._backward_tile, kernel._addmm_fp32
    kernel._forward_tile = kernel._backward_tile = kernel._addmm_fp32 = nothing
    try:
        yield
    finally:
        kernel._forward_tile, kernel._backward_tile, kernel._addmm_fp32 = saved


@contextlib.contextmanager
def head_fold(job):
    """The fused head's fold for the whole run (forward and backward): `_triton_fold` on the
    "triton" path, TRL's torch fold as is on "torch"; nothing without the fused head. On meta
    tensors the kernel's autocast query names the device "meta", which torch's autocast does
    not know: it reads the emulated CUDA autocast instead (`_MetaAutocastTorch`)."""
    if not job.fused:
        yield
        return
    from trl.kernels import chunked_logprob as kernel

    meta = next(job.model.parameters()).is_meta
    saved = kernel.torch
    if meta:
        kernel.torch = _MetaAutocastTorch(job.amp)
    try:
        with _triton_fold() if _head["path"] == "triton" else contextlib.nullcontext():
            yield
    finally:
        kernel.torch = saved


class _MetaAutocastTorch:
    """`torch` as chunked_logprob.py sees it on meta tensors: `is_autocast_enabled("meta")` and
    `get_autocast_dtype("meta")` answer with the emulated CUDA autocast (`trace.autocast
    .CudaAutocast`, None: off), every other name is torch's."""

    def __init__(self, amp):
        self._amp = amp

    def __getattr__(self, name):
        return getattr(torch, name)

    def is_autocast_enabled(self, device_type=None):
        if device_type == "meta":
            return self._amp is not None and self._amp.enabled
        return torch.is_autocast_enabled(device_type)

    def get_autocast_dtype(self, device_type):
        return self._amp.dtype if device_type == "meta" else torch.get_autocast_dtype(device_type)


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
    labels and a padded batch's attention mask (int64, `padded_mask`), with the loop's `num_items_in_batch`
    (`Trainer._get_num_items_in_batch`: the count of labels not -100 over the parallel
    degrees, a true division: a 0-dim fp32 tensor)."""
    ids = batch["input_ids"]
    return {**batch, "attention_mask": padded_mask(ids),
            "num_items_in_batch": torch.zeros((), device=ids.device)}


def padded_mask(ids: torch.Tensor) -> torch.Tensor:
    """The attention mask of a padded batch (TRL's collators pad a batch of varied lengths to
    its longest): ones, the last row's last position a pad. With a pad in it, masking_utils
    builds the (b, 1, s, s) mask on real tensors too (`_ignore_causal_mask_sdpa` skips it for
    an all-ones mask, which fake tensors cannot tell), so a real run of this batch and its
    trace make the same tensors."""
    mask = torch.ones_like(ids)
    mask[-1, -1] = 0
    return mask


# ---------------------------------------------------------------- DPO

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
    rows, cols = _positions(half, max(prompt - 1, 0), seq - 1, input_ids.device)
    out["mean_chosen_logits"] = logits[:half][rows, cols].mean()
    out["mean_rejected_logits"] = logits[half:][rows, cols].mean()
    return out


def dpo_loss(job, spec) -> torch.Tensor:
    """`get_batch_loss_metrics`: the policy's concatenated forward, then the reference's log
    probs (`compute_ref_log_probs`: no_grad; or the batch's precomputed ones), then the
    sigmoid loss (`dpo_loss`, loss_type "sigmoid")."""
    half, prompt = spec.micro_batch, rules.prompt_length(spec)
    policy = dpo_forward(job.model, job.batch, half, prompt)
    if rules.ref_model_of(spec) == "precomputed":
        ref_chosen, ref_rejected = job.batch["ref_chosen_logps"], job.batch["ref_rejected_logps"]
    else:
        model, ctx = reference_context(job, spec)
        with part(job, REFERENCE), torch.no_grad(), ctx:
            ref = dpo_forward(model, job.batch, half, prompt)
        ref_chosen, ref_rejected = ref["chosen_logps"], ref["rejected_logps"]
    beta = rules.beta_of(spec)
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
    if rules.ref_model_of(spec) == "precomputed":
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
    loss = 0.0 + (-F.logsigmoid(rules.beta_of(spec) * delta)).mean() * 1.0
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
    if rules.ref_model_of(spec) == "precomputed":
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
    beta = rules.beta_of(spec)
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


# ---------------------------------------------------------------- ORPO

def _batch_logps(logits, labels, average: bool) -> torch.Tensor:
    """ORPO / KTO `get_batch_logps`: shift, mask the label pad (-100), per-token log-probs."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != -100
    labels = torch.where(labels == -100, 0, labels)
    per_token_logps = selective_log_softmax(logits, labels)
    if average:
        return (per_token_logps * loss_mask).sum(-1) / loss_mask.sum(-1)
    return (per_token_logps * loss_mask).sum(-1)


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
    all_logps = _batch_logps(logits, labels, average=True)
    chosen_logps, rejected_logps = all_logps[:half], all_logps[half:]
    log_odds = (chosen_logps - rejected_logps) - (
        torch.log1p(-torch.exp(chosen_logps)) - torch.log1p(-torch.exp(rejected_logps)))
    ratio = F.logsigmoid(log_odds)
    return nll - (rules.beta_of(spec) * ratio).mean()


# ---------------------------------------------------------------- KTO

def kto_forward(job, model, spec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """trl/trainer/kto_trainer.py `forward`: the KL batch's log-probs under no_grad
    (`_compute_kl_logps`), then the completions' forward, their log-probs, and the desirable /
    undesirable split by index (copies of the logits' rows, kept as the metrics read them)."""
    batch = job.batch
    with torch.no_grad():
        kl_logits = model(batch["kl_input_ids"], use_cache=False).logits
        kl_logps = _batch_logps(kl_logits, batch["kl_labels"], average=False)
        del kl_logits
    logits = model(batch["input_ids"], use_cache=False).logits
    logps = _batch_logps(logits, batch["labels"], average=False)
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
    if rules.ref_model_of(spec) == "precomputed":
        ref_chosen, ref_rejected, ref_kl = (job.batch["ref_chosen_logps"],
                                            job.batch["ref_rejected_logps"],
                                            job.batch["ref_kl_logps"])
    else:
        model, ctx = reference_context(job, spec)
        with part(job, REFERENCE), torch.no_grad(), ctx:
            ref_chosen, ref_rejected, ref_kl, _ = kto_forward(job, model, spec)
    beta = rules.beta_of(spec)
    kl_term = (kl - ref_kl).mean().clamp(min=0).detach()
    losses = torch.cat((1 - F.sigmoid(beta * ((chosen - ref_chosen) - kl_term)),
                        1 - F.sigmoid(beta * (kl_term - (rejected - ref_rejected)))), 0)
    return losses.nanmean()


# ---------------------------------------------------------------- reward model

def rm_loss(job, spec) -> torch.Tensor:
    """trl/trainer/reward_trainer.py `compute_loss`: the scalar rewards of the concatenated
    chosen + rejected batch (`AutoModelForSequenceClassification`, num_labels=1: the score of
    each sequence's last token), `-logsigmoid(chosen - rejected).mean()`."""
    half = spec.micro_batch
    rewards = job.model(input_ids=job.batch["input_ids"],
                        attention_mask=job.batch.get("attention_mask"), use_cache=False).logits
    return -F.logsigmoid(rewards[:half] - rewards[half:]).mean()


# ---------------------------------------------------------------- GRPO

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
    completion = rules.completion_length(spec)
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
    if rules.ref_model_of(spec) != "none":
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
    job.grpo = grpo
    full = torch.cat([grpo["prompt_ids"], grpo["completion_ids"]], dim=1)
    mask = torch.cat([grpo["prompt_mask"], grpo["completion_mask"]], dim=1)
    with torch.no_grad(), autocast():
        if rules.old_logps(spec):
            with part(job, GENERATION):
                grpo["old"] = grpo_fused_logps(job.model, full, mask, completion,
                                               spec.micro_batch)
        if rules.ref_model_of(spec) != "none":
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
    n, keep = spec.micro_batch, rules.completion_length(spec)
    part_of = {k: v[micro * n:(micro + 1) * n] for k, v in job.grpo.items()}
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
        per_token_loss = per_token_loss + rules.beta_of(spec) * kl
    normalizer = mask.sum().clamp(min=1.0)  # num_items_in_batch: the masks' count
    return (per_token_loss * mask).sum() / normalizer


def grpo_loss(job, spec, micro: int) -> torch.Tensor:
    """grpo_trainer.py `_compute_loss` on micro-step `micro`'s slice: the policy's per-token
    log-probs (entropy under no_grad), the clipped importance ratio against the detached
    log-probs (old = current: num_iterations 1), the KL to the reference when beta > 0, the
    masked token mean."""
    n, completion = spec.micro_batch, rules.completion_length(spec)
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
        per_token_loss = per_token_loss + rules.beta_of(spec) * kl
    return per_token_loss.sum() / per_token_loss.numel()


def loss(job, spec, micro: int = 0) -> torch.Tensor:
    """The objective's loss of one micro-step (the runner's `model(**batch).loss`)."""
    o = spec.objective
    if o == "sft":  # TRL's SFTTrainer through its fused head (`uses_fused_head`)
        return sft_trl_loss(job, spec)
    if o == "dpo" and job.fused:
        return dpo_fused_loss(job, spec)
    if o == "kto" and job.fused:
        return kto_fused_loss(job, spec)
    if o == "grpo":
        return (grpo_fused_loss if job.fused else grpo_loss)(job, spec, micro)
    return {"dpo": dpo_loss, "orpo": orpo_loss, "kto": kto_loss, "rm": rm_loss}[o](job, spec)


# ---------------------------------------------------------------- batch and reference

def batch(spec, device=None, fused: bool = False) -> dict:
    """The collated batch of the objective (token 1 stands for any id; -100 the label pad):
    DPO the concatenated ids and loss mask (prompt tokens out); ORPO ids and labels; KTO the
    completions and the KL batch; RM the concatenated ids; GRPO a stand-in (the generation
    makes its ids). `precomputed` reference log-probs: fp32 per sequence, in the batch.
    `fused`: the trainer's own collator at a TRL with the fused head (`uses_fused_head`)."""
    o, n, s = spec.objective, spec.micro_batch, spec.seq_len
    rows = rules.rows(spec)
    ids = torch.ones(rows, s, dtype=torch.long, device=device)
    out = {"input_ids": ids}
    prompt = rules.prompt_length(spec)
    if o == "dpo":
        mask = torch.ones(rows, s, dtype=torch.long, device=device)
        mask[:, :prompt] = 0
        out["loss_mask"] = mask
        if fused:  # DataCollatorForPreference (trl >= 1.15): the attention and completion masks
            out = {"input_ids": ids, "attention_mask": padded_mask(ids), "completion_mask": mask}
    if o in rules.PADDED:  # their collators pad chosen and rejected to the longest
        out["attention_mask"] = padded_mask(ids)
    if o in ("orpo", "kto"):
        labels = torch.ones(rows, s, dtype=torch.long, device=device)
        labels[:, :prompt] = -100
        out["labels"] = labels
    if o == "kto":
        out["kl_input_ids"] = torch.ones(n, s, dtype=torch.long, device=device)
        out["kl_labels"] = labels.clone()
        if fused:  # KTOTrainer's collator (trl >= 1.15): masks, the KL batch's, the labels
            completion = torch.ones(n, s, dtype=torch.long, device=device)
            completion[:, :prompt] = 0
            out = {"input_ids": ids, "attention_mask": padded_mask(ids),
                   "completion_mask": completion, "KL_input_ids": out["kl_input_ids"],
                   "KL_attention_mask": padded_mask(ids), "KL_completion_mask": completion.clone(),
                   "label": torch.arange(n, device=device) % 2 == 0}
    if rules.ref_model_of(spec) == "precomputed":
        names = ("ref_chosen_logps", "ref_rejected_logps") + (("ref_kl_logps",)
                                                              if o == "kto" else ())
        if fused and o == "kto":  # KTOTrainer's precomputed columns (trl >= 1.15)
            names = ("ref_logps", "ref_KL_logps")
        for name in names:
            out[name] = torch.zeros(n, device=device)
    return out


def reference_model(spec, config, build_model):
    """TRL `create_reference_model`: a frozen deep copy of the policy as loaded (its dtype),
    in eval mode; None unless the reference is `separate`."""
    if rules.ref_model_of(spec) != "separate":
        return None
    ref = build_model(spec, config)
    ref.requires_grad_(False)
    ref.eval()
    return ref


def uses_fused_head(spec) -> bool:
    """`objective.fused_head` with the installed TRL (importable: the trace runs its code)."""
    from hybridmem.environment import installed

    return rules.fused_head(spec, installed("trl"))


def check_model(spec, image_tokens: int, model_type: str) -> None:
    """`job.objective.check_model` on the built batch."""
    rules.check_model(spec, image_tokens, model_type)
