"""The head of a decoder under an objective beyond SFT: the tensors of the trainer's loss.

The code paths are `hybridmem.objectives.steps`' (TRL's, cited there); here they are counted
in closed form. R = rows of the policy's forward (2 x micro_batch concatenated), S = tokens,
V = vocabulary, e = the logits' dtype (the compute dtype), ls = bytes of a row's log_softmax
output (fp32 under autocast, whose CUDA lists run log_softmax in fp32; else e).

- `selective_log_softmax` on fp32 logits: a gather and a per-row logsumexp, which saves its
  input: the logits stay saved for backward; otherwise per row a log_softmax whose (S, V)
  output is saved (under autocast beside the row's fp32 cast, a transient) and the logits die
  when the forward's function returns.
- DPO's mean-logits metrics copy each half's completion logits (half x n x V, e) in turn.
- ORPO: the chosen half's `[..., :-1, :].contiguous()` copy into cross_entropy (log_softmax's
  output saved; under autocast the fp32 cast transient), then the per-token log-probs on
  `logits[:, :-1]`.
- KTO: the per-token log-probs of the micro_batch completions, then the desirable /
  undesirable split's index copies of the logits' rows (freed when `forward` returns).
- GRPO: `logits_to_keep = completion + 1` (`_grpo_head`).
- The reward model's `score` head: R x S x 1 logits, nothing vocabulary-sized.
Each objective's plug-in names its formula (`HEAD`, a key of `objectives.protocol.HEADS`);
`HEADS` below holds their closed forms, and `objective_head` dispatches through the plug-in.
Backward: the per-row grads wait in the unbind's input buffer until every row has one (each
row's saved output released as its grad arrives), then stack into the logits' grad
(R x S x V, e).
"""

from __future__ import annotations

from functools import partial

from hybridmem.allocator.alloc import t
from hybridmem.families.common.activations import (
    FP32, INT64, Acts, Ctx, Saved, dora_linears, dora_saved, linear_inputs, lora_matrices,
    lora_outputs,
)
from hybridmem.models.graph import Layer
from hybridmem.objectives import REGISTRY


def _row_bytes(c: Ctx) -> int:
    """Bytes per element of a row's log_softmax output (`selective_log_softmax`)."""
    return FP32 if c.amp else c.e


def _logps(c: Ctx, rows: int, seq: int, V: int) -> tuple[int, int, int]:
    """(saved, forward transient beside the logits, backward transient) of
    `selective_log_softmax` over `rows` rows of `seq` positions."""
    e = c.e
    if e == FP32 and not c.amp:  # gather + logsumexp: the logits themselves are saved
        # backward: the logsumexp rows' grads stacked (`for lg in logits` is an unbind:
        # UnbindBackward stacks them) wait in the logits' input buffer while the gather's
        # backward makes its zeros and their `scatter_add` (aten gather_backward): three
        # (rows x seq x V) fp32 tensors at once (the trace of the step: tests/test_objectives.py)
        return 0, t(seq, FP32), t(rows * seq * V, FP32) * 3
    ls = _row_bytes(c)
    cast = t(seq * V, FP32) if c.amp and e != FP32 else 0
    saved = rows * t(seq * V, ls)
    # backward, last row first: a row's gather grad and log_softmax grad (ls) and its cast
    # back (e) beside every saved row; each row's saved output is released as its grad joins
    # the unbind's input buffer, whose rows are stacked into the logits' grad at the end
    first = 2 * t(seq * V, ls) + t(seq * V, e)
    last = rows * t(seq * V, e) + t(rows * seq * V, e) - saved
    return saved, cast, max(first, last)


def objective_head(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """The lm_head's input and autocast copies, then the head formula the job's objective
    plug-in names (`HEADS`)."""
    d = layer.dims
    R, S, h, V = d["b"], d["s"], d["h"], d["vocab"]
    B = R * S
    sv = Saved()
    n_lora = len(lora_matrices(layer)) // 2
    linear_inputs(sv, c, B * h, c.stream, 1, need_w, n_lora, shared=False, in_grad=need_in)
    lora_outputs(sv, c, B, n_lora)
    dora_saved(sv, c, B, dora_linears(layer), need_in)
    copies = cache = 0
    if c.amp:
        w = t(V * h, 2)
        copies = (w if need_in or need_w else 0) + sum(t(p.numel, 2) for p in lora_matrices(layer))
        cache = (w if need_w else 0) + sum(t(p.numel, 2) for p in lora_matrices(layer))
    return HEADS[REGISTRY[c.objective].HEAD](R, S, h, V, c, sv, copies, cache, need_w)


def _score_head(R: int, S: int, h: int, V: int, c: Ctx, sv: Saved, copies: int, cache: int,
                need_w: bool) -> Acts:
    """The reward model's score head: (R, S, 1) scores, the last token's read."""
    B, e = R * S, c.e
    logits = t(B * V, e)
    return Acts(saved=sv.total + copies, parts=(copies, *sv.sizes), cache=cache,
                fwd_extra=logits, fwd_parts=(logits,), bwd_extra=logits + t(B * h, e),
                bwd_parts=(logits, t(B * h, e)))


def _mean_logits_loss(R: int, S: int, V: int, c: Ctx, sv: Saved) -> tuple[int, int, int]:
    """DPO: the log-probs of every row, then each half's mean-logits copy (`_logps`' triple)."""
    saved, row, bwd_loss = _logps(c, R, S, V)
    half, n = R // 2, S - 1 - max(c.prompt - 1, 0)
    sv.add(R * S, INT64)  # the rolled labels, gather's index
    return saved, max(row, t(half * n * V, c.e)), bwd_loss  # a row's cast, or a half's copy


def _nll_loss(R: int, S: int, V: int, c: Ctx, sv: Saved) -> tuple[int, int, int]:
    """ORPO: the chosen half's shifted NLL beside the log-probs of every row."""
    e = c.e
    nll_rows = R // 2 * (S - 1)
    ls = FP32 if (c.amp or e == FP32) else e
    nll_saved = t(nll_rows * V, ls)
    nll_fwd = t(nll_rows * V, e) + (t(nll_rows * V, FP32) if c.amp and e != FP32 else 0)
    saved, row, bwd_loss = _logps(c, R, S - 1, V)
    sv.add(R * (S - 1), INT64)
    return saved + nll_saved, max(nll_fwd, row), max(bwd_loss, 2 * nll_saved)


def _split_loss(R: int, S: int, V: int, c: Ctx, sv: Saved) -> tuple[int, int, int]:
    """KTO: the per-token log-probs of R sequences, then the desirable / undesirable split:
    `logits[idx]` copies every row once, after the log-probs' row work (kto_trainer.py
    `forward`)."""
    saved, row, bwd_loss = _logps(c, R, S - 1, V)
    sv.add(R * (S - 1), INT64)
    return saved, max(row, _split_copies(R, S, V, c.e)), bwd_loss


def _on_logits(loss, R: int, S: int, h: int, V: int, c: Ctx, sv: Saved, copies: int,
               cache: int, need_w: bool) -> Acts:
    """The full (R, S, V) logits, then `loss`'s (saved, forward transient, backward
    transient); fp32 logits outside autocast stay saved for backward (`_logps`)."""
    B, e = R * S, c.e
    saved, top, bwd_loss = loss(R, S, V, c, sv)
    fwd = [top]
    sv.add(saved, 1)
    if e == FP32 and not c.amp:
        sv.add(B * V, e)
    else:
        fwd.insert(0, t(B * V, e))
    bwd = [t(B * V, e), t(B * h, e)] + ([t(V * h, 2)] if c.amp and need_w else [])
    return Acts(saved=sv.total + copies, parts=(copies, *sv.sizes), cache=cache,
                fwd_extra=sum(fwd), fwd_parts=tuple(fwd), bwd_extra=sum(bwd),
                bwd_parts=tuple(bwd), bwd_mlp=bwd_loss, bwd_mlp_parts=(bwd_loss,))


def _grpo_head(R: int, S: int, h: int, V: int, c: Ctx, sv: Saved, copies: int, cache: int,
               need_w: bool) -> Acts:
    """GRPO's policy head (grpo_trainer.py `_get_per_token_logps_and_entropies`): the logits of
    the last k + 1 positions only (`logits_to_keep`, k = completion), their `/ temperature`
    copy over k positions beside them, then the copy's per-token log-probs (the ids' slice is
    gather's index: no new tensor) and, under no_grad, one row's entropy (log_softmax, exp and
    their product). The kept logits die when the copy replaces them, before the rows' saved
    log_softmax outputs exist (`fwd_after_top`)."""
    e = c.e
    k = S - c.prompt
    kept, copy = t(R * (k + 1) * V, e), t(R * k * V, e)
    saved, row, bwd_loss = _logps(c, R, k, V)
    sv.add(saved, 1)
    keeps_copy = e == FP32 and not c.amp
    if keeps_copy:  # selective_log_softmax saves the fp32 copy itself
        sv.add(R * k * V, e)
    ls = _row_bytes(c)
    entropy = 3 * t(k * V, ls)
    if keeps_copy:  # the copy is saved: the kept logits are the transient beside it
        fwd, after = [kept, max(row, entropy)], 0
        top = sum(fwd)
    else:  # the kept logits die at the copy; the rows' saved outputs come after them (the
        # event stream allocates the copy and a row's work before them)
        fwd, after = [copy, max(row, entropy)], saved
        top = copy + max(kept, saved + max(row, entropy))
    # the division's grad (the copy's stacked grad freed at it), the slice's zero-filled grad
    # over k + 1, the hidden states' grad; the rows' saved outputs are gone (each released as
    # its grad arrived: `bwd_top_freed`)
    bwd = [copy, kept, t(R * S * h, e)] + (
        [t(V * h, 2)] if c.amp and need_w else [])
    return Acts(saved=sv.total + copies, parts=(copies, *sv.sizes), cache=cache,
                fwd_extra=top, fwd_parts=tuple(fwd), bwd_extra=sum(bwd),
                bwd_parts=tuple(bwd), bwd_mlp=bwd_loss, bwd_mlp_parts=(bwd_loss,),
                fwd_after_top=after, bwd_top_freed=0 if keeps_copy else saved)


HEADS = {"score": _score_head,
         "logps_mean_logits": partial(_on_logits, _mean_logits_loss),
         "logps_nll": partial(_on_logits, _nll_loss),
         "logps_split": partial(_on_logits, _split_loss),
         "logps_kept": _grpo_head}
"""The closed form of each head formula an objective names (`objectives.protocol.HEADS`; its
`LM_HEAD` is `decoder_acts.lm_head`'s own)."""


def _split_copies(R: int, S: int, V: int, e: int) -> int:
    """KTO's chosen / undesirable logits: two index copies of alternating rows (rows 0, 2, ...
    and 1, 3, ...: kto_trainer.py `forward`, `logits[chosen_idx, ...]`)."""
    return t((R + 1) // 2 * S * V, e) + t(R // 2 * S * V, e)


def reference_head(R: int, S: int, h: int, V: int, c: Ctx, prompt: int, objective: str) -> int:
    """High point of the reference's head under no_grad (`compute_ref_log_probs`): the logits,
    the frozen lm_head's autocast weight cast (not cached: no grad), then one row's
    log_softmax work (fp32 cast and output), DPO's half's mean-logits copy or KTO's split
    copies. KTO's KL batch runs the same forward first, its logits freed before these."""
    e = c.e
    logits = t(R * S * V, e)
    cast = t(V * h, 2) if c.amp else 0
    row = 0 if (e == FP32 and not c.amp) else t(S * V, _row_bytes(c)) + (
        t(S * V, FP32) if c.amp and e != FP32 else 0)
    copy = REFERENCE_COPIES.get(REGISTRY[objective].HEAD)  # the other heads copy none
    return logits + max(cast, row, copy(R, S, V, e, prompt) if copy else 0)


def _mean_logits_copy(R: int, S: int, V: int, e: int, prompt: int) -> int:
    """DPO's half's mean-logits copy (half x completion x V)."""
    return t(R // 2 * (S - 1 - max(prompt - 1, 0)) * V, e)


REFERENCE_COPIES = {"logps_mean_logits": _mean_logits_copy,
                    "logps_split": lambda R, S, V, e, prompt: _split_copies(R, S, V, e)}
"""The head formulas whose reference forward copies logits beside its log-probs."""


# TRL's fused LM head (trl/kernels/chunked_logprob.py, read at trl 1.16.0): tokens per tile
# (`TOKEN_CHUNK_SIZE`) and the tile's vocabulary width (trl/trainer/utils.py
# `_CHUNKED_LOGPROB_CHUNK_SIZE`); the tile buffer `mm_buf` is (min(N, 4096), 32768) wide
# whatever the vocabulary
TRL_TOKEN_CHUNK = 4096
TRL_VOCAB_CHUNK = 32768
TRL_ACCUMULATORS = 7  # running max, sum_exp, x_sum_exp, sq_sum_exp, z_sum, max_before_target,
#                       target_logit: (N,) fp32 each (`ChunkedLogProbFunction.forward`)


def trl_fused_head(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """lm_head + loss of TRL's SFTTrainer through `add_fused_lm_head` on a GPU (the Triton
    path; `hybridmem.objectives.steps._triton_fold` says why the kernels make nothing).

    N = b x (s - 1) scored positions (the last token has no label; every position is scored
    on the priced, fully labelled batch). Saved: the hidden states' copy (`last_hidden_state[:,
    :-1].reshape(-1, H)`, a non-contiguous slice: N x H in the stream dtype), the clamped
    targets (N int64), log_z and the entropy (N fp32 each), the label mask's complement that
    `masked_fill` keeps (N bool). Forward top: the seven (N,) fp32 accumulators beside the tile
    buffer (min(N, 4096) x 32768, compute dtype) and the per-tile casts of the hidden chunk and
    the weight chunk where their dtype is not the compute dtype. Backward top: the tile buffer,
    the fp32 accumulators of the input grad (N x H) and, when the head trains, of the weight
    grad (V x H: the weight's grad itself when the weight is fp32, else beside its cast), the
    incoming (N,) grad, the per-tile casts."""
    d = layer.dims
    b, s, h, V = d["b"], d["s"], d["h"], d["vocab"]
    n = b * max(s - 1, 0)
    e = c.e
    rows = min(n, TRL_TOKEN_CHUNK)
    tile = t(rows * TRL_VOCAB_CHUNK, e)
    casts = ([t(rows * h, e)] if c.stream != e else []) + (
        [t(min(V, TRL_VOCAB_CHUNK) * h, e)] if c.param != e else [])
    sv = Saved()
    sv.add(n * h, c.stream)  # the hidden states' copy
    sv.add(n, INT64)         # targets
    sv.add(n, FP32, times=2)  # log_z, entropy
    sv.add(n, 1)             # ~mask (masked_fill's)
    fwd = (*[t(n, FP32)] * TRL_ACCUMULATORS, tile, *casts)
    bwd = [tile, t(n, FP32), *casts]
    if need_in:
        bwd.append(t(n * h, FP32))  # grad_hidden
    if need_w and c.param != FP32:
        bwd.append(t(V * h, FP32))  # grad_weight's fp32 accumulator beside the cast grad
    return Acts(saved=sv.total, parts=tuple(sv.sizes), fwd_extra=sum(fwd), fwd_parts=fwd,
                bwd_extra=sum(bwd), bwd_parts=tuple(bwd))


def trl_reference_head(R: int, S: int, h: int, V: int, c: Ctx) -> int:
    """High point of a reference's fused head under no_grad (DPOTrainer's
    `add_fused_lm_head(self.ref_model)`, or the policy's under disabled adapters): the hidden
    states' copy (N x H, stream dtype), the targets (N int64), the seven (N,) fp32
    accumulators and the tile buffer with its casts (`trl_fused_head`); nothing is saved."""
    n = R * max(S - 1, 0)
    rows = min(n, TRL_TOKEN_CHUNK)
    casts = (t(rows * h, c.e) if c.stream != c.e else 0) + (
        t(min(V, TRL_VOCAB_CHUNK) * h, c.e) if c.param != c.e else 0)
    return (t(n * h, c.stream) + t(n, INT64) + TRL_ACCUMULATORS * t(n, FP32)
            + t(rows * TRL_VOCAB_CHUNK, c.e) + casts)
