"""Where an eager attention layer's forward peaks, and what is alive there.

Why: eager attention's b·a·s² tensors dominate small models at long sequences, and counting
them on top of every tensor the layer saves (MLP included) over-counts the forward by a
probs-sized tensor plus the layer's second half. The op order (transformers 5.24
`modeling_llama.eager_attention_forward`, the same in every family: `matmul(q, kᵀ) * scaling`
[Gemma 2: `/ cap`, `tanh`, `* cap`] `+ mask`, `softmax(dtype=float32).to(q.dtype)`, then
`matmul(probs, v)`), with each op's output freed once its last reference goes:
- `* scaling` / `+ mask` / softmax: one pre-softmax scores tensor is alive beside the next;
- `attn_weights = softmax(attn_weights).to(q.dtype)`: the variable keeps the `+ mask` output
  alive until the assignment, so at the cast the softmax output, its cast (both saved) and
  that scores tensor coexist: the high point is every tensor saved up to and including the
  probs (q, k, v copies, tanh output, softmax output, cast) + one scores tensor, whose dtype
  is the `+ mask` promotion (the mask has the embeddings' dtype: fp32 under autocast).
Nothing of the layer's second half (o_proj input, post-attention norm, MLP) exists yet.
Measured against the trace tier (tracker events, tiny-llama fp32 s256): the forward's top is
that `+ mask` output beside the softmax output, 2 probs, not 3.
"""

from __future__ import annotations

from hybridmem.allocator.alloc import t


def forward_top(probs: int, score_bytes: int, at_probs: int, total: int,
                other: tuple[int, ...], ckpt: bool, e: int,
                beside: tuple[int, ...] = ()) -> tuple[tuple[int, ...], int]:
    """(forward transients, bytes of `total` saved after them) of a layer with eager
    attention. `probs`: b·a·s² elements (0: not eager); `at_probs`: saved bytes once the probs
    exist; `total`: all the layer saves; `other`: the layer's other forward transients
    (RoPE, DoRA, quantised linears), counted on top of everything saved as before; `beside`:
    unsaved tensors alive beside the scores (the attention call's arguments).

    Checkpointed layers run their first forward under no_grad, where nothing is saved and the
    scores, softmax and cast are transients beside q, k, v: two probs-sized tensors on top of
    the checkpointed input, as before (`timeline.walk` adds `kept`, not `saved`)."""
    if not probs or ckpt:
        return (*other, *[t(probs, e)] * (2 if probs else 0)), 0
    scores = (t(probs, score_bytes), *beside)
    if at_probs + sum(scores) >= total + sum(other):
        return scores, total - at_probs
    return other, 0


def backward_top(probs: int, e: int, resid: int, grad_v: int, freed: int, other: int,
                 keep: tuple[int, ...] = ()) -> tuple[tuple[int, ...], int] | None:
    """The attention backward's eager high point, if above the half's other one (`other`:
    bytes on top of every saved tensor): (transients, saved bytes freed before it), or None.

    Autograd runs o_proj's, then `matmul(probs, v)`'s backward, each releasing its saved
    tensors once it ran (o_proj's input, v, the probs cast: `freed`); `_to_copy`'s backward
    casts the probs grad to fp32 (the compute-dtype grad then dies), and
    `_softmax_backward_data` writes a second fp32 probs tensor: the top is those two beside
    the v grad (`grad_v`) and the residual grad (`resid`). Measured on tiny-llama s256 (the
    trace's alloc/free events): fp32, bf16 and bf16-mixed all peak there. `keep`: tensors
    alive through the whole backward (Gemma's checkpointed masks)."""
    if not probs:
        return None
    parts = (resid, grad_v, t(probs, 4), t(probs, 4), *keep)
    if sum(parts) - freed <= other:
        return None
    return parts, freed
