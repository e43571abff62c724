"""The torch code the objectives' steps share (`hybridmem.objectives.<name>.step`), as TRL runs it.

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

import torch
import torch.nn.functional as F

from hybridmem import objectives

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


def positions(rows: int, start: int, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
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
    if objectives.ref_model_of(spec) == "adapter":
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
    "entropy", "is_top1")` (the objective's `FUSED_OUTPUTS`: DPOTrainer's and KTOTrainer's ask
    for "mean_logits" too). Its forward then runs TRL's
    `_ChunkedLogProbFunction` (trl/kernels/chunked_logprob.py): the head in tiles of
    `TOKEN_CHUNK_SIZE` (4096) tokens x 32,768 vocabulary entries, fp32 accumulators."""
    from trl.trainer.utils import add_fused_lm_head

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, outputs=objectives.of(spec).FUSED_OUTPUTS)


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


def padded_mask(ids: torch.Tensor) -> torch.Tensor:
    """The attention mask of a padded batch (TRL's collators pad a batch of varied lengths to
    its longest): ones, the last row's last position a pad. With a pad in it, masking_utils
    builds the (b, 1, s, s) mask on real tensors too (`_ignore_causal_mask_sdpa` skips it for
    an all-ones mask, which fake tensors cannot tell), so a real run of this batch and its
    trace make the same tensors."""
    mask = torch.ones_like(ids)
    mask[-1, -1] = 0
    return mask


def batch_logps(logits, labels, average: bool) -> torch.Tensor:
    """ORPO / KTO `get_batch_logps`: shift, mask the label pad (-100), per-token log-probs."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != -100
    labels = torch.where(labels == -100, 0, labels)
    per_token_logps = selective_log_softmax(logits, labels)
    if average:
        return (per_token_logps * loss_mask).sum(-1) / loss_mask.sum(-1)
    return (per_token_logps * loss_mask).sum(-1)



# ---------------------------------------------------------------- batch and reference

def ones(rows: int, seq: int, device=None, prompt: int = 0, fill: int = 1) -> torch.Tensor:
    """A collated (rows, seq) int64 column: token 1 stands for any id (or a mask's 1), the
    first `prompt` positions `fill` (a completion mask's 0, the label pad -100)."""
    out = torch.ones(rows, seq, dtype=torch.long, device=device)
    if fill != 1:
        out[:, :prompt] = fill
    return out


def with_precomputed(out: dict, spec, names: tuple[str, ...], device=None) -> dict:
    """`out` with the batch's precomputed reference log-probs (TRL `precompute_ref_log_probs`:
    fp32 per sequence, one column per name) when the reference is `precomputed`."""
    if objectives.ref_model_of(spec) == "precomputed":
        for name in names:
            out[name] = torch.zeros(spec.micro_batch, device=device)
    return out


def reference_model(spec, config, build_model):
    """TRL `create_reference_model`: a frozen deep copy of the policy as loaded (its dtype),
    in eval mode; None unless the reference is `separate`."""
    if objectives.ref_model_of(spec) != "separate":
        return None
    ref = build_model(spec, config)
    ref.requires_grad_(False)
    ref.eval()
    return ref


def uses_fused_head(spec) -> bool:
    """`objectives.fused_head` with the installed TRL (importable: the trace runs its code)."""
    from hybridmem.environment import installed

    return objectives.fused_head(spec, installed("trl"))

