"""Activation formulas of OLMo 2's language model (transformers 5.24 `modeling_olmo2.py`), op by
op with PyTorch's `tools/autograd/derivatives.yaml`; what differs from the Llama layer of
`common/decoder_acts.py`, whose pieces (linear inputs, attention, adapters) it reuses:

- no input norm: q/k/v read the layer input itself (saved once for their weight grads in a
  pure run; under autocast each linear saves its own bf16 cast);
- `Olmo2RMSNorm`: `x.to(float32)` (a copy unless x is fp32) saved by `pow` and by the rsqrt
  multiply, the rsqrt (one fp32 per token), and `weight * normed` runs in fp32 before
  `.to(input_dtype)`: the fp32 normalised tensor is what the weight's grad saves (Llama's
  saves the cast-back one). q_norm / k_norm take the projection's whole width;
  post_attention_layernorm the o_proj output, post_feedforward_layernorm the down_proj output
  (both in the matmul dtype);
- the MLP reads the residual stream (attention output + input), as Llama's reads its norm's
  output: the same bytes;
- RoPE: `Olmo2RotaryEmbedding` returns fp32 cos / sin (no cast to the activations' dtype),
  `apply_rotary_pos_emb` casts q and k back (`.to(q_type)`): nothing saved but cos / sin.
"""

from __future__ import annotations

from dataclasses import replace

from hybridmem.allocator.alloc import t
from hybridmem.families.common.activations import (
    FP32, Acts, Ctx, Saved, adapters_on, amp_copies, attention_core, dora_forward, dora_linears,
    quant_transients,
)
from hybridmem.families.common import decoder_acts as TA
from hybridmem.models.graph import Layer


def norm_saved(sv: Saved, tokens: int, width: int, grad: bool, need_w: bool) -> None:
    """What one `Olmo2RMSNorm` over `width` saves: the fp32 input and the rsqrt when its input
    needs a grad, the fp32 normalised tensor when its weight does."""
    sv.add(tokens * width, FP32, grad)
    sv.add(tokens, FP32, grad)
    sv.add(tokens * width, FP32, need_w)


def norm_backward(tokens: int, width: int) -> tuple[int, ...]:
    """The top of one `Olmo2RMSNorm`'s backward: the fp32 chain `x * rsqrt(x.pow(2).mean(-1) +
    eps)` (the cast's fp32 grad, the normalised tensor's grad, pow's `2 * x` product and the
    input's fp32 grad), as Gemma's fp32 norm (`common/decoder_acts.py`)."""
    return (t(tokens * width, FP32),) * 4


def decoder_layer(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """`Olmo2DecoderLayer`: attention with full-width q/k norms and a post-norm, a SwiGLU MLP
    with a post-norm, each added to the residual stream; the linears' pieces are the shared
    decoder's (`common/decoder_acts.py`), what differs is the norms' placement and kind."""
    sh = TA.shape(layer)
    b, s, B, h, f, qd, kvd = sh.b, sh.s, sh.B, sh.h, sh.f, sh.qd, sh.kvd
    lora = bool(layer.lora)
    if not (need_in or need_w or lora) or not layer.runs:
        return Acts()
    e, sb = c.e, c.stream
    sv = Saved()
    # q / k / v read the layer input (no pre-norm)
    TA.qkv_saved(sv, c, layer, sh, 3, need_in, need_w)
    for proj, width in (("q_proj", qd), ("k_proj", kvd)):
        norm_saved(sv, B, width, need_in or need_w or adapters_on(layer, (proj,)) > 0, need_w)
    probs = attention_core(sv, c, b, s, layer.dims["heads"], qd, kvd)
    at_probs = sv.total
    o_saved = TA.o_proj_saved(sv, c, layer, sh, need_in, need_w)
    norm_saved(sv, B, h, True, need_w)  # post_attention_layernorm on the attention output
    attn_part = sv.total
    # the MLP reads the residual stream h1 = input + normed attention output
    TA.gate_up_saved(sv, c, layer, sh, 2, need_w)
    quant_gu = {"mlp.gate_proj.weight"} & set(layer.quantized)
    mlp_e = sb if quant_gu else e  # a quantised gate returns its input's dtype
    # gate output (SiLU input), SiLU output, up output; down_proj's input
    m_saved = TA.act_down_saved(sv, c, layer, sh, mlp_e, 3, need_w)
    norm_saved(sv, B, h, True, need_w)  # post_feedforward_layernorm on the MLP output
    copies, cache = amp_copies(layer, c, True, need_w)
    # forward top, RoPE: the normed q and k (matmul dtype), q's rotated fp32 result, and k's
    # `k * cos`, `rotate_half(k) * sin` and their fp32 sum (apply_rotary_pos_emb)
    fwd_parts = (t(B * qd, e), t(B * kvd, e), t(B * qd, FP32), *[t(B * kvd, FP32)] * 3)
    # ... or, in half precision, down_proj's when larger (also a checkpointed layer's
    # recompute top, as Llama's under autocast): the residual stream h1 is the layer's local
    # until the last add (trace tier, tiny-olmo2 LoRA b2 s64 checkpointed, bf16 and bf16-mixed)
    mlp_parts = TA.down_proj_top(c, layer, sh, need_w, fp32_copy=c.adapter != e)
    if e != FP32 and sum(mlp_parts) > sum(fwd_parts):
        fwd_parts = mlp_parts
    dora = dora_forward(c, dora_linears(layer))
    fwd_parts = dora if sum(dora) > sum(fwd_parts) else fwd_parts
    # backward: the MLP half starts with post_feedforward_layernorm's fp32 chain, then
    # grad(m) with grad(act), grad(up); the attention half with post_attention_layernorm's,
    # then dq, dk, dv (and q_norm's / k_norm's chains, smaller than post-norm's at h >= qd)
    grad_m = max(0, t(B * f, e) - m_saved)
    mlp_stages = [norm_backward(B, h), (t(B * f, e),) * 2 + ((grad_m,) if grad_m else ())]
    mlp_bwd_parts = max(mlp_stages, key=sum)
    attn_bwd_parts = max([norm_backward(B, h), (t(B * qd, e),) * 3], key=sum)
    if c.attn == "flash_attention_2":
        attn_bwd_parts += (t(B * qd, FP32),)  # dq_accum (fp32) inside flash-attn backward
    q_fwd, q_mlp, q_attn = quant_transients(layer, c, B, {"o_proj": e, "down_proj": mlp_e},
                                            lora=lora)
    bwd_parts = (t(B * h, sb), t(B * h, sb), *attn_bwd_parts, *q_attn)
    top = TA.eager_backward(probs, c, sh, o_saved, kvd, sum(bwd_parts))
    bwd_freed = 0
    if top:
        bwd_parts, bwd_freed = top
    bwd_mlp_parts = (t(B * h, sb), *mlp_bwd_parts, *q_mlp)
    fwd_parts = q_fwd if sum(q_fwd) > sum(fwd_parts) else fwd_parts
    fwd_parts, after_top = TA.eager_forward(c, probs, at_probs, sv.total, fwd_parts, B, qd, kvd)
    fp32_inputs = t(B * qd, FP32) + t(B * kvd, FP32) + 2 * t(B * h, FP32)
    return Acts(saved=sv.total + copies, parts=(copies, *sv.sizes),
                ckpt_saved=t(B * h, sb), cache=cache, fwd_extra=sum(fwd_parts),
                # each norm's fp32 input is saved twice (pow and the rsqrt multiply)
                shared=fp32_inputs,
                bwd_extra=sum(bwd_parts), bwd_top_freed=bwd_freed,
                mlp_saved=sv.total - attn_part, bwd_mlp=sum(bwd_mlp_parts),
                # a pure run's q/k/v save the layer input itself: the checkpoint's tensor
                ckpt_alias=t(B * h, sb) if not c.amp and need_w else 0,
                recompute_extra=0 if probs else sum(fwd_parts),
                fwd_parts=fwd_parts, bwd_parts=bwd_parts, fwd_after_top=after_top,
                bwd_mlp_parts=bwd_mlp_parts)


def rotary(layer: Layer, c: Ctx, active: bool) -> Acts:
    """The decoder's rotary tables (`common/decoder_acts.py rotary`) with cos / sin in fp32 whatever
    the activations' dtype (`Olmo2RotaryEmbedding.forward` returns them uncast)."""
    acts = TA.rotary(layer, c, active)
    if not active:
        return acts
    d = layer.dims
    table = d["s"] * d["head_dim"]
    return replace(acts, saved=acts.saved + 2 * (t(table, FP32) - t(table, c.stream)))


def rmsnorm(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """The final `Olmo2RMSNorm` on the residual stream (`norm_saved`). Forward transients: the
    fp32 product `weight * normed` and its cast back (the lm_head's input), with the
    normalised tensor when the weight does not save it."""
    d = layer.dims
    B, h = d["b"] * d["s"], d["h"]
    if not (need_in or need_w):
        return Acts()
    sv = Saved()
    norm_saved(sv, B, h, need_in, need_w)
    fwd_parts = ((t(B * h, FP32),) if c.stream != FP32 else ()) + (
        (t(B * h, FP32),) if not need_w else ())
    return Acts(saved=sv.total, parts=tuple(sv.sizes), fwd_extra=sum(fwd_parts),
                fwd_parts=fwd_parts, bwd_extra=2 * t(B * h, c.stream))
