"""Packed (padding-free) batches in the analytic tier: `hybridmem.techniques.packing`'s rules as steps.

The graph is built for one row of micro_batch x seq_len tokens (`packing.graph_spec`): every
per-token tensor, the loss and eager's scores over the whole row come out of the ordinary
formulas. On top (transformers 5.x masking_utils.py `sdpa_mask` with a packed-sequence mask):

- the batch carries `position_ids` (1, L) int64;
- sdpa: the block-diagonal (1, 1, L, L) bool mask lives through the forward (the model's
  `causal_mask`), and each attention layer's SDPA converts it to the query dtype
  (aten/src/ATen/native/transformers/attention.cpp `convert_boolean_attn_mask`: `where(mask,
  0, -inf)`) and saves that for backward: L x L x compute-dtype bytes per layer (measured so
  on CPU, trace == real run; on CUDA the mem-efficient kernel takes the same converted bias —
  not checked on a GPU);
- sdpa with a mask and GQA: transformers' `use_gqa_in_sdpa` (integrations/sdpa_attention.py)
  needs `attention_mask is None` on CUDA, so `repeat_kv` expands k and v to all query heads
  and SDPA saves those copies: per layer 2 x L x (heads - kv_heads) x head_dim more bytes;
- eager: the float mask the unpacked one-row graph already has (eager always materialises it);
- flash_attention_2: nothing (varlen over cu_seqlens).
"""

from __future__ import annotations

from dataclasses import replace

from hybridmem.allocator.alloc import t

INT64 = 8


def position_ids_bytes(spec) -> int:
    return t(spec.micro_batch * spec.seq_len, INT64) if spec.packing else 0


def apply(priced: list, spec, compute_bytes: int) -> list:
    """`priced` rows of the one-row graph with sdpa's packed-mask tensors added."""
    if not spec.packing or spec.attn != "sdpa":
        return priced
    L = spec.micro_batch * spec.seq_len
    bias = t(L * L, compute_bytes)
    out = []
    for p in priced:
        s = p.step
        if p.layer.kind == "decoder_layer" and s.on_path and s.acts.saved:
            d = p.layer.dims
            extra = bias + 2 * (t(L * d["heads"] * d["head_dim"], compute_bytes)
                                - t(L * d["kv_heads"] * d["head_dim"], compute_bytes))
            a = s.acts
            if s.ckpt:  # saved only inside the recompute
                a = replace(a, bwd_extra=a.bwd_extra + extra, bwd_parts=(*a.bwd_parts, extra),
                            bwd_mlp=a.bwd_mlp + extra if a.bwd_mlp else 0)
            else:
                a = replace(a, saved=a.saved + extra, parts=(*a.parts, extra))
            s = replace(s, acts=a)
        elif p.layer.kind == "rotary":  # the bool mask, made next to the rotary embedding
            s = replace(s, fwd_only=s.fwd_only + t(L * L, 1))
        out.append(replace(p, step=s))
    return out
