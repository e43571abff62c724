"""Op-level selective checkpointing (`--grad-ckpt-policy ops`) in the analytic tier.

`hybridmem.techniques.sac`'s policy (torchtitan `_apply_op_sac`) as bytes per checkpointed layer:
what the selective-checkpoint cache keeps from the forward to the recompute (on top of the
layer's input, as full checkpointing keeps), and which of those the recompute does not make
again (they are in the layer's ordinary saved set, so the recompute's peak shrinks by them).

Decoder layer (Llama: seven bias-free linears, `aten.mm` in the order q, k, v, o, gate, up,
down; every second one recomputed): kept q, v, gate, down outputs + SDPA's out and logsumexp;
of those v (saved by SDPA), gate (SiLU's input), out and logsumexp are in the ordinary saved
set, q (RoPE saves cos / sin, not q) and down (the residual add saves nothing) are not.
Eager attention runs its matmuls as `bmm` (not in the list): only the projection mms.
Encoder layer (CLIP: linears with a bias are `aten.addmm`, not in the list): SDPA's out and
logsumexp only. Adapters (LoRA) add mms that shift the count: not priced here
(`scope.refusal`).
"""

from __future__ import annotations

from dataclasses import replace

from hybridmem.families.common.activations import FP32, LSE_ALIGN_EFFICIENT
from hybridmem.allocator.alloc import t
from hybridmem.families import layer_kind


def _lse(c, b: int, s: int, heads: int) -> int:
    rows = s  # as activations.attention_core: flash / cuDNN one fp32 row per query
    if c.e == FP32 and c.attn != "flash_attention_2":
        rows = -(-s // LSE_ALIGN_EFFICIENT) * LSE_ALIGN_EFFICIENT
    return t(b * heads * rows, FP32)


def cached(layer, c) -> tuple[int, int, int]:
    """(bytes the cache keeps, of which in the ordinary saved set, of which the MLP's)."""
    d = layer.dims
    e = c.e
    if layer.kind == "decoder_layer":
        B = d["b"] * d["s"]
        qd, kvd = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
        mm = t(B * qd, e) + t(B * kvd, e) + t(B * d["ffn"], e) + t(B * d["h"], e)
        overlap_mm = t(B * kvd, e) + t(B * d["ffn"], e)
        attn = 0 if c.attn == "eager" else t(B * qd, e) + _lse(c, d["b"], d["s"], d["heads"])
        return mm + attn, overlap_mm + attn, t(B * d["ffn"], e)
    sac_as = layer_kind(layer.kind).sac_as  # Pixtral's block: a Llama layer over (1, N)
    if sac_as is not None:
        return cached(sac_as(layer), c)
    if layer.kind == "encoder_layer" and c.attn != "eager":
        N = d["n"] * d["t"]
        attn = t(N * d["h"], e) + _lse(c, d["n"], d["t"], d["heads"])
        return attn, attn, 0
    return 0, 0, 0


def apply(priced: list, spec, c) -> list:
    if not (spec.grad_ckpt and spec.grad_ckpt_policy == "ops"):
        return priced
    out = []
    for p in priced:
        s = p.step
        if s.ckpt and s.on_path and s.acts.saved:
            keep, overlap, mlp = cached(p.layer, c)
            a = s.acts
            s = replace(s, acts=replace(a, ckpt_saved=a.ckpt_saved + keep,
                                        saved=a.saved - overlap,
                                        mlp_saved=max(a.mlp_saved - mlp, 0)))
        out.append(replace(p, step=s))
    return out
