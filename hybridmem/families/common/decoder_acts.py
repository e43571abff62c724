"""Activation formulas of the decoder LLM: Llama/Mistral/Qwen2 layers, final norm, lm_head
with the loss, token embedding, rotary tables (sources: `hybridmem.families.common.activations`)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridmem.families.common.activations import (
    FP32, INT64, Acts, Ctx, Saved, adapters_on, amp_copies, attention_core, dora_forward,
    dora_linears, dora_saved, linear_inputs, lora_matrices, lora_outputs, quant_transients,
)
from hybridmem.allocator.alloc import t
from hybridmem.families.common.eager_top import backward_top, forward_top
from hybridmem.techniques.kernels import LIGER_SM_COUNT, torch_chunks
from hybridmem.models.graph import Layer


QKV = ("q_proj", "k_proj", "v_proj", "qkv_proj")
GU = ("gate_proj", "up_proj", "gate_up_proj")


@dataclass(frozen=True, slots=True)
class Shape:
    """The sizes a decoder layer's formulas read (`shape`): batch, sequence, hidden, MLP width,
    tokens (b·s), the q and kv projections' widths."""

    b: int
    s: int
    h: int
    f: int
    B: int
    qd: int
    kvd: int


def shape(layer: Layer) -> Shape:
    d = layer.dims
    b, s = d["b"], d["s"]
    return Shape(b, s, d["h"], d["ffn"], b * s, d["heads"] * d["head_dim"],
                 d["kv_heads"] * d["head_dim"])


def qkv_saved(sv: Saved, c: Ctx, layer: Layer, sh: Shape, n_base: int, need_in: bool,
              need_w: bool, bnb: bool = False) -> None:
    """q/k/v (or the fused qkv_proj) over the B x h stream-dtype input: what the linears, their
    LoRA outputs and DoRA keep (bitsandbytes adapters, `linear_inputs` bnb: only a half input
    skips PEFT's fp32 copy)."""
    n_qkv = adapters_on(layer, QKV)
    linear_inputs(sv, c, sh.B * sh.h, c.stream, n_base, need_w, n_qkv, shared=False,
                  in_grad=need_in, bnb=bnb)
    lora_outputs(sv, c, sh.B, n_qkv)
    dora_saved(sv, c, sh.B, dora_linears(layer, QKV), need_in)


def o_proj_saved(sv: Saved, c: Ctx, layer: Layer, sh: Shape, need_in: bool,
                 need_w: bool) -> int:
    """o_proj's input: eager's transpose(1,2).contiguous() copy; SDPA/flash output is reused.
    Returns the bytes it saved."""
    before = sv.total
    n_o = adapters_on(layer, ("o_proj",))
    linear_inputs(sv, c, sh.B * sh.qd, c.e, 1, need_w, n_o, shared=c.attn != "eager",
                  in_grad=need_in or adapters_on(layer, QKV) > 0,
                  bnb="self_attn.o_proj.weight" in layer.quantized)
    lora_outputs(sv, c, sh.B, n_o)
    dora_saved(sv, c, sh.B, dora_linears(layer, ("o_proj",)), True)
    return sv.total - before


def gate_up_saved(sv: Saved, c: Ctx, layer: Layer, sh: Shape, n_base: int, need_w: bool,
                  bnb: bool = False) -> None:
    """gate / up (or the fused gate_up_proj) over the B x h stream-dtype input."""
    n_gu = adapters_on(layer, GU)
    linear_inputs(sv, c, sh.B * sh.h, c.stream, n_base, need_w, n_gu, shared=False, bnb=bnb)
    lora_outputs(sv, c, sh.B, n_gu)
    dora_saved(sv, c, sh.B, dora_linears(layer, GU), True)


def act_down_saved(sv: Saved, c: Ctx, layer: Layer, sh: Shape, mlp_e: int, times: int,
                   need_w: bool, bnb: bool = False) -> int:
    """The SwiGLU's saved operands (`times` B x f tensors of `mlp_e` bytes: gate output, SiLU
    output, up output) and down_proj's input; returns down_proj's input as its adapter saves
    it (bytes)."""
    sv.add(sh.B * sh.f, mlp_e, times=times)
    before = sv.total
    n_down = adapters_on(layer, ("down_proj",))
    linear_inputs(sv, c, sh.B * sh.f, c.e, 1, need_w, n_down, shared=False, bnb=bnb)
    m_saved = sv.total - before
    lora_outputs(sv, c, sh.B, n_down)
    dora_saved(sv, c, sh.B, dora_linears(layer, ("down_proj",)), True)
    return m_saved


def down_proj_top(c: Ctx, layer: Layer, sh: Shape, need_w: bool, fp32_copy: bool
                  ) -> tuple[int, ...]:
    """The MLP's high point under half-precision compute (down_proj's forward): the residual /
    normed stream (stream dtype, the layer's local), SiLU x up when down_proj's frozen weight
    does not save it, and with an adapter PEFT lora.Linear.forward's base result, its fp32
    `_cast_input_dtype` copy of the input (`fp32_copy`), lora_B's output and its scaled copy.
    A checkpointed layer reaches it again in its recompute, the output's grad waiting (trace
    tier, tiny-llama / tiny-olmo2 LoRA b2 s64 checkpointed: the step's peak)."""
    B, h, f, e = sh.B, sh.h, sh.f, c.e
    n_down = adapters_on(layer, ("down_proj",))
    return (t(B * h, c.stream), *([t(B * f, e)] if not need_w else ()),
            *([*([t(B * f, FP32)] if fp32_copy else []), *[t(B * h, e)] * 3]
              if n_down else ()))


def eager_backward(probs: int, c: Ctx, sh: Shape, o_saved: int, v_width: int, other: int,
                   keep: tuple[int, ...] = ()):
    """eager: the probs' backward (`eager_top.backward_top`), after o_proj's input, v (a
    repeat_kv copy, or the projection's output, `v_width` wide) and the probs cast were
    released."""
    e = c.e
    v_saved = t(sh.B * (sh.qd if sh.kvd < sh.qd else v_width), e)
    return backward_top(probs, e, t(sh.B * sh.h, c.stream), t(sh.B * sh.qd, e),
                        o_saved + v_saved + (t(probs, e) if e != FP32 else 0), other, keep)


def decoder_layer(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """Llama/Mistral/Qwen2 decoder layer: RMSNorm, GQA attention with RoPE, SwiGLU MLP; the
    families' traits (fused projections, Gemma's norms, q/k norms, experts) switch its parts."""
    d = layer.dims
    sh = shape(layer)
    lora = bool(layer.lora)
    active = need_in or need_w or lora
    if not active or not layer.runs:
        return Acts()
    sv = Saved()
    fused = bool(d.get("fused"))  # Phi-3: one qkv_proj, one gate_up_proj (decoder.FUSED_TYPES)
    gem = bool(d.get("gemma"))  # Gemma 2: four (1 + weight) fp32 norms (decoder.GEMMA_TYPES)
    sparse = bool(d.get("moe"))  # Mixtral / Qwen3-MoE sparse block (decoder.MOE_TYPES)
    probs, at_probs, o_saved, attn_part = _attention_half(sv, c, layer, sh, need_in, need_w,
                                                          fused, gem)
    moe_fwd, moe_bwd, m_saved, mlp_e = _mlp_half(sv, c, layer, sh, need_w, fused, gem, sparse)
    copies, cache = amp_copies(layer, c, active, need_w)
    fwd_parts = _forward_parts(c, layer, sh, need_w, moe_fwd if sparse else ())
    bw = _backward(c, layer, sh, probs, fused, gem, sparse, moe_bwd, m_saved, mlp_e, o_saved,
                   lora)
    fwd_parts = bw.q_fwd if sum(bw.q_fwd) > sum(fwd_parts) else fwd_parts  # not alive together
    # eager's with-grad top in a recompute (scores beside the saved half) is not priced yet
    recompute_extra = 0 if probs else sum(fwd_parts)
    fwd_parts, after_top = eager_forward(c, probs, at_probs, sv.total, fwd_parts, sh.B, sh.qd,
                                         sh.kvd)
    B, h, sb = sh.B, sh.h, c.stream
    return Acts(saved=sv.total + copies, parts=(copies, *sv.sizes),
                ckpt_saved=t(B * h, sb), cache=cache, fwd_extra=sum(fwd_parts),
                # both norms' fp32 inputs, saved twice each (TRL's offloader keeps the second
                # copy on the GPU); Liger's RMSNorm saves its input once
                shared=0 if c.liger else t(B * h, FP32) * (int(need_in) + 1),
                bwd_extra=bw.extra, bwd_top_freed=bw.freed,
                mlp_saved=sv.total - attn_part,
                bwd_mlp=bw.mlp,
                # the input norm's fp32 input is the layer input when the stream is fp32
                # (`_norm_saved`, `gemma_norm_saved`); Liger's saves X too, not priced so yet;
                # eager keeps the older recompute (its scores top unpriced, docs/quantize.md)
                ckpt_alias=t(B * h, FP32) if sb == FP32 and need_in and not (c.liger or probs)
                else 0,
                recompute_extra=recompute_extra,
                fwd_parts=fwd_parts,
                bwd_parts=bw.parts,
                fwd_after_top=after_top,
                bwd_mlp_parts=bw.mlp_parts)


def _attention_half(sv: Saved, c: Ctx, layer: Layer, sh: Shape, need_in: bool, need_w: bool,
                    fused: bool, gem: bool) -> tuple[int, int, int, int]:
    """What the input norm, q/k/v, the q/k norms, attention and o_proj save (and Gemma's
    post-attention norm): (probs bytes, saved at the probs, o_proj's saved bytes, saved at the
    attention half's end)."""
    d = layer.dims
    B, h, qd, kvd = sh.B, sh.h, sh.qd, sh.kvd
    norm = gemma_norm_saved if gem else _norm_saved
    # input RMSNorm: fp32 input (or upcast copy), rsqrt; normalised input for the weight grad
    norm(sv, c, B, h, need_in, need_w)
    qkv_saved(sv, c, layer, sh, 1 if fused else 3, need_in, need_w,
              bnb=bool({"self_attn.q_proj.weight", "self_attn.qkv_proj.weight"}
                       & set(layer.quantized)))
    if d.get("qk_norm"):
        for proj, width, rows in (("q_proj", qd, d["heads"]), ("k_proj", kvd, d["kv_heads"])):
            grad = need_in or need_w or adapters_on(layer, (proj,)) > 0
            head_norm(sv, c, B, width, rows, grad, need_w, gemma=gem)
    probs = attention_core(sv, c, sh.b, sh.s, d["heads"], qd, kvd,
                           qkv=B * (qd + 2 * kvd) if fused else 0,
                           softcap=bool(d.get("attn_softcap")),
                           rep_kv=bool(d.get("masked")) and c.attn == "sdpa")
    mask_bytes = image_mask_saved(d, c)  # a VLM's per-layer image masks (Gemma 3)
    sv.add(mask_bytes, 1, cond=mask_bytes > 0)
    at_probs = sv.total  # eager: saved up to the probs and their cast (`eager_top`)
    o_saved = o_proj_saved(sv, c, layer, sh, need_in, need_w)
    if gem:  # post_attention_layernorm on the attention output, before the residual add
        gemma_norm_saved(sv, c, B, h, True, need_w)
    return probs, at_probs, o_saved, sv.total


def _mlp_half(sv: Saved, c: Ctx, layer: Layer, sh: Shape, need_w: bool, fused: bool,
              gem: bool, sparse: bool):
    """What the post-attention norm and the MLP (or the sparse block) save: (the sparse
    block's forward and backward transients, down_proj's saved input, the gate/up output's
    dtype bytes)."""
    B, h = sh.B, sh.h
    norm = gemma_norm_saved if gem else _norm_saved
    # post-attention RMSNorm on the residual h1 (always on the grad path once active; Gemma's
    # pre_feedforward_layernorm)
    norm(sv, c, B, h, True, need_w, hf_in=FP32)
    moe_fwd = moe_bwd = ()
    if sparse:
        moe_fwd, moe_bwd = moe_saved(sv, c, layer.dims, need_w)
    else:
        gate_up_saved(sv, c, layer, sh, 1 if fused else 2, need_w,
                      bnb=bool({"mlp.gate_proj.weight", "mlp.gate_up_proj.weight"}
                               & set(layer.quantized)))
    # a quantised gate/up returns its input's dtype (bnb Linear4bit `.to(inp_dtype)`): the
    # stream's, fp32 under autocast
    quant_gu = {"mlp.gate_proj.weight", "mlp.gate_up_proj.weight"} & set(layer.quantized)
    mlp_e = c.stream if quant_gu else c.e
    # gate output (SiLU input), SiLU output, up output (mul operands); fused: gate and up are
    # `chunk` views of one B x 2f output, the same bytes; Liger's SiLUMul saves a and b only
    # and recomputes silu in backward (liger_kernel/ops/swiglu.py). (Over fp32 weights the
    # quantised gate/up make an fp32 product: priced as a cast copy.)
    m_saved = 0
    if not sparse:
        m_saved = act_down_saved(sv, c, layer, sh, mlp_e, 2 if c.liger else 3, need_w,
                                 bnb="mlp.down_proj.weight" in layer.quantized and not c.amp)
    if gem:  # post_feedforward_layernorm on the MLP output
        gemma_norm_saved(sv, c, B, h, True, need_w)
    return moe_fwd, moe_bwd, m_saved, mlp_e


def _forward_parts(c: Ctx, layer: Layer, sh: Shape, need_w: bool, moe_fwd) -> tuple[int, ...]:
    """The forward's transients on top of what is saved: RoPE's rotated q, k (fp32 under
    autocast), or under autocast down_proj's high point when larger (always with Liger's
    in-place RoPE), or the sparse block's, or DoRA's (not alive together)."""
    B, qd, kvd, e = sh.B, sh.qd, sh.kvd, c.e
    rope_parts = [t(B * qd, FP32), t(B * kvd, FP32)] if c.amp else [t(B * qd, e)] * 2
    if c.liger:  # LigerRopeFunction rotates q, k in place (liger_kernel/ops/rope.py)
        rope_parts = []
    fwd_parts = tuple(rope_parts)
    if c.autocast:
        # the post-attention norm's output is read by the linears through their bf16 casts, so
        # not saved; a bitsandbytes down_proj under autocast makes no fp32 copy
        # (`linear_inputs` bnb)
        down_bnb = "mlp.down_proj.weight" in layer.quantized and not c.amp
        mlp_parts = down_proj_top(c, layer, sh, need_w, fp32_copy=not down_bnb)
        fwd_parts = mlp_parts if sum(mlp_parts) > sum(fwd_parts) else fwd_parts
    if moe_fwd and sum(moe_fwd) > sum(fwd_parts):
        fwd_parts = moe_fwd
    dora = dora_forward(c, dora_linears(layer))
    return dora if sum(dora) > sum(fwd_parts) else fwd_parts  # not alive together


@dataclass(frozen=True, slots=True)
class _Backward:
    parts: tuple[int, ...]
    extra: int
    freed: int
    mlp: int
    mlp_parts: tuple[int, ...]
    q_fwd: tuple[int, ...]


def _backward(c: Ctx, layer: Layer, sh: Shape, probs: int, fused: bool, gem: bool,
              sparse: bool, moe_bwd, m_saved: int, mlp_e: int, o_saved: int,
              lora: bool) -> _Backward:
    """The backward's transients: the grad of the layer output, then in the MLP grad(m) with
    grad(act), grad(up) (m itself is freed once down_proj's backward ran); in attention dq,
    dk, dv."""
    d = layer.dims
    b, s, B, h, f, qd, kvd = sh.b, sh.s, sh.B, sh.h, sh.f, sh.qd, sh.kvd
    e, sb = c.e, c.stream
    n_qkv, n_o = adapters_on(layer, QKV), adapters_on(layer, ("o_proj",))
    n_gu, n_down = adapters_on(layer, GU), adapters_on(layer, ("down_proj",))
    mlp_bwd = 2 * t(B * f, e)
    # ... unless nothing saves m (frozen down_proj without an adapter): then grad(m) is one
    # more (trace tier, tiny-llava projector fp32 checkpointed: the step's peak)
    grad_m = 0 if sparse or c.liger else max(0, t(B * f, e) - m_saved)
    mlp_bwd += grad_m
    if c.liger:  # SiLUMul backward writes da, db into a's and b's storage: grad(c) only
        mlp_bwd = t(B * f, e)
    if sparse:
        mlp_bwd = sum(moe_bwd)
    # Gemma's post_feedforward_layernorm backward runs first, before any MLP grad: the fp32
    # `_norm` chain (`x * rsqrt(x.pow(2).mean(-1) + eps)`: mean's expand, pow's `2 * x` and
    # its product, beside the rsqrt product's grad), four B x h fp32 tensors at its top (trace
    # tier, tiny-gemma2 eager bf16 s64 b2 checkpointed: the step's peak). Counted under eager
    # only for now: Gemma 3 under SDPA has the same chain, but adding it there moves the SDPA
    # numbers (tiny-gemma3-text bf16-mixed ckpt b2 +0.8 -> +2.7 %), left to a separate change
    gem_bwd = 4 * t(B * h, FP32) if gem and probs else 0
    if gem_bwd > mlp_bwd:
        mlp_bwd = gem_bwd
    attn_bwd = 3 * t(B * qd, e)  # eager's probs grads: `backward_top` below
    qkv_out = qd + 2 * kvd if fused else qd  # widest attention-input linear's output
    if fused:
        # q/k/v are slices of one output: each slice's backward (`slice_backward`) makes a
        # zero-filled full-size grad, added into autograd's input buffer of the fused output
        attn_bwd += 2 * t(B * qkv_out, e)
    if not c.autocast and e != c.adapter:
        # the fp32 adapter branch: its output grad is cast to fp32 (B x out) and lora_A returns
        # an fp32 input grad (B x in) before the cast back (PEFT lora.Linear in bf16 models)
        if n_gu or n_down:
            mlp_bwd += t(B * f * (2 if fused else 1), FP32) + t(B * h, FP32)
        if n_qkv or n_o:
            attn_bwd += t(B * qkv_out, FP32) + t(B * h, FP32)
    elif c.autocast:
        # autocast: lora_A's bf16 input grad is cast back to fp32 (the stream's dtype, or
        # peft's fp32 `_cast_input_dtype` copy over half weights) (B x in)
        mlp_bwd += t(B * h, FP32) if (n_gu or n_down) else 0
        attn_bwd += t(B * h, FP32) if (n_qkv or n_o) else 0
    if c.attn == "flash_attention_2":
        attn_bwd += t(B * qd, FP32)  # dq_accum (fp32) inside flash-attn backward
    soft = []
    if probs and c.ckpt:
        # eager under checkpointing: the float masks (one per layer type, b x s x s in the
        # embeddings' dtype) are held by the checkpoints' inputs through the backward. Gemma
        # 2's tanh_backward runs after softmax's fp32 grads are freed: no higher point
        soft = [t(b * s * s, sb)] * d.get("mask_types", 1)
        attn_bwd += sum(soft)
    staged = c.quant is not None and c.quant.four_bit and not (sparse or gem or c.liger)
    q_fwd, q_mlp, q_attn = quant_transients(
        layer, c, B, {"o_proj": e, "down_proj": mlp_e}, lora=lora, staged=staged)
    bwd_parts = (t(B * h, sb), t(B * h, sb), *[t(B * qd, e)] * 3, *soft, *q_attn)
    bwd_extra = 2 * t(B * h, sb) + attn_bwd + sum(q_attn)
    top = eager_backward(probs, c, sh, o_saved, (qd + 2 * kvd) if fused else kvd, bwd_extra,
                         tuple(soft))
    bwd_freed = 0
    if top:
        bwd_parts, bwd_freed = top
        bwd_extra = sum(bwd_parts)
    bwd_mlp, bwd_mlp_parts = t(B * h, sb) + mlp_bwd + sum(q_mlp), (
        t(B * h, sb), *(moe_bwd if sparse else [t(B * h, FP32)] * 4 if gem_bwd == mlp_bwd else
                        [t(B * f, e)] * (1 if c.liger else 2)), *([grad_m] if grad_m else ()),
        *q_mlp)
    if q_mlp and staged:  # MatMul4Bit's order (MatMul8bitLt keeps its input in ctx)
        bwd_mlp, bwd_mlp_parts = quant_mlp_backward(t(B * h, sb), t(B * f, mlp_e), m_saved,
                                                    q_mlp)
    return _Backward(bwd_parts, bwd_extra, bwd_freed, bwd_mlp, bwd_mlp_parts, q_fwd)


def quant_mlp_backward(grad_out: int, act: int, m_saved: int, q_mlp: tuple[int, ...]
                       ) -> tuple[int, tuple[int, ...]]:
    """(bytes, tensors) on top of `saved` at the high point of a quantised SwiGLU MLP's
    backward: the layer output's grad `grad_out`, then the larger of two stages, both after
    down_proj's adapter branch freed the input it saved (`m_saved`; `quant_transients`):
    down_proj's base backward with the adapter's input grad (`q_mlp`, the largest quantised
    MLP linear's), or the gated product's backward: grad(m) with grad(act), grad(up) (three
    `act`-sized tensors: a quantised gate/up returns the stream's dtype, fp32 under autocast
    or kbit prep). Measured (trace tier, tiny-llama nf4 LoRA b2 s64, bf16 and bf16-mixed,
    checkpointed): both stages reach the step's peak, at equal bytes."""
    parts = max([act] * 3, list(q_mlp), key=sum)
    return grad_out + sum(parts) - m_saved, (grad_out, *parts)


def eager_forward(c: Ctx, probs: int, at_probs: int, total: int, other: tuple[int, ...],
                  B: int, qd: int, kvd: int) -> tuple[tuple[int, ...], int]:
    """A decoder layer's forward top under eager attention (`eager_top.forward_top`): the
    scores are the `+ mask` output (the float mask has the stream's dtype, so fp32 under
    autocast); under autocast `.to(q.dtype)` is a no-op (RoPE's q is fp32) and the bf16 cast
    is `matmul`'s, made after the scores died. Alive beside them, not saved: the attention
    call's arguments (modeling_llama.LlamaAttention.forward locals): RoPE's q (matmul saves a
    contiguous copy) and, when repeat_kv copies them, RoPE's k and the projection's v."""
    if not probs:
        return other, 0
    score_bytes = max(c.e, c.stream)
    if c.amp:
        at_probs -= t(probs, c.e)
    rope_e = FP32 if c.amp else c.e
    args = (t(B * qd, rope_e), *((t(B * kvd, rope_e), t(B * kvd, c.e)) if kvd < qd else ()))
    return forward_top(probs, score_bytes, at_probs, total, other, c.ckpt, c.e, args)


def _norm_saved(sv: Saved, c: Ctx, B: int, h: int, need_in: bool, need_w: bool,
                hf_in: int | None = None) -> None:
    """What an RMSNorm saves. transformers LlamaRMSNorm: the fp32 input (`hf_in`; an upcast
    copy in a pure half run, else the stream tensor) and rsqrt when the input needs a grad, the
    normalised input for the weight grad. LigerRMSNormFunction (liger_kernel/ops/rms_norm.py):
    X itself (stream dtype) and RSTD (rows, fp32) whenever it is on the grad path."""
    if c.liger:
        sv.add(B * h, c.stream, need_in or need_w)
        sv.add(B, FP32, need_in or need_w)
        return
    sv.add(B * h, hf_in or FP32, need_in)
    sv.add(B, FP32, need_in)
    sv.add(B * h, c.stream, need_w)


def moe_saved(sv: Saved, c: Ctx, d: dict, need_w: bool) -> tuple[list[int], list[int]]:
    """What a sparse MoE block saves, and its (forward, backward) high points; S = tokens x
    top_k routed rows. Every expert's weights are parameters; activations are the routed
    rows only. transformers' default experts (`integrations/moe.py
    grouped_mm_experts_forward`: sort the (token, slot) pairs by expert, one grouped matmul per
    projection over all S rows, offsets from `histc`) process exactly S rows whatever the
    routing, so the bytes do not depend on which experts are picked: a closed form with no
    routing assumption (the meta-tensor trace records the same ops).

    Router (MixtralTopKRouter / Qwen3MoeTopKRouter): its input (the norm's output) for the
    weight grad, softmax's fp32 output (B x E), topk's int64 indices (B x k), and with the
    renormalisation (`/=`: in place) the sum (B, fp32) and a clone of the top values (B x k
    fp32). Experts: the sort permutation and `perm // k` (S int64, saved by two `index` ops),
    the gathered rows (S x h), the routing weights in the sorted order (S; fp32 for Mixtral,
    cast back to the compute dtype for Qwen3-MoE), the offsets (E int32), the gate_up output
    (S x 2f, gate and up are `chunk` views), SiLU's output and the product (S x f each), the
    down output (S x h, saved by the weighting multiply) and the inverse permutation (S
    int64). Forward top: the weighted rows (S x h, promoted to fp32 by Mixtral's fp32
    weights) and their un-permuted copy, then the (B x h) sum. Backward top: the
    un-permute's and the multiply's S x h grads with the compute-dtype cast."""
    B, h, f = d["b"] * d["s"], d["h"], d["ffn"]
    n, k = d["experts"], d["top_k"]
    S, e = B * k, c.e
    w = FP32 if d.get("router_fp32_weights") else e
    linear_inputs(sv, c, B * h, c.stream, 1, need_w, 0, shared=False)   # router input
    sv.add(B * n, FP32)                                                 # softmax output
    sv.add(B * k, INT64)                                                # topk indices
    sv.add(B, FP32, cond=bool(d.get("router_norm")))                    # the sum
    sv.add(B * k, FP32, cond=bool(d.get("router_norm")))                # in-place div's self
    sv.add(S, INT64, times=2)                                           # perm, perm // k
    sv.add(S * h, e)                                                    # gathered rows
    sv.add(S, w)                                                        # sorted weights
    sv.add(n, 4)                                                        # offsets (int32)
    sv.add(S * 2 * f, e)                                                # gate_up output
    sv.add(S * f, e, times=2)                                           # silu, product
    sv.add(S * h, e)                                                    # down output
    sv.add(S, INT64)                                                    # inverse perm
    fwd = [t(S * h, w), t(S * h, w), t(B * h, w)]
    bwd = [t(S * h, w), t(S * h, w), t(S * h, e)]
    return fwd, bwd


def gemma_norm_saved(sv: Saved, c: Ctx, B: int, h: int, need_in: bool, need_w: bool,
                     hf_in: int | None = None) -> None:
    """What a Gemma RMSNorm saves (modeling_gemma2.Gemma2RMSNorm.forward:
    `_norm(x.float()) * (1.0 + weight.float())`, then `.type_as(x)`): the fp32 input (an
    upcast copy unless x is fp32) and rsqrt when the input needs a grad, the fp32 normalised
    tensor for the weight grad (the weight multiply runs in fp32, before the cast), and
    `1 + weight` (h, fp32) for the input's grad. `hf_in` is unused: the input is always
    saved in fp32."""
    sv.add(B * h, FP32, need_in)
    sv.add(B, FP32, need_in)
    sv.add(B * h, FP32, need_w)
    sv.add(h, FP32, need_in)


def head_norm(sv: Saved, c: Ctx, tokens: int, width: int, rows: int, grad: bool,
              need_w: bool, gemma: bool = False) -> None:
    """Qwen3's q_norm / k_norm (`Qwen3RMSNorm(head_dim)` on the projection's output viewed as
    tokens x heads x head_dim; modeling_qwen3.Qwen3RMSNorm.forward): `.to(float32)` (a copy in
    bf16, the projection's output itself in fp32) saved by `pow` and the rsqrt mul, the rsqrt
    (one fp32 per head row), and the normalised tensor cast back to the projection's dtype,
    saved by `weight * x` for the weight's grad. `grad`: the projection's output requires grad."""
    if gemma:  # Gemma3RMSNorm(head_dim): the weight multiply in fp32 (`gemma_norm_saved`)
        gemma_norm_saved(sv, c, tokens * rows, width // rows, grad, need_w)
        return
    sv.add(tokens * width, FP32, grad)
    sv.add(tokens * rows, FP32, grad)
    sv.add(tokens * width, c.e, grad and need_w)


def rmsnorm(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """Final RMSNorm: fp32 input, rsqrt; normalised input for the weight grad.

    Forward transients (transformers LlamaRMSNorm.forward: `hidden * rsqrt(var + eps)` in fp32,
    then `.to(input_dtype)`): the fp32 normalised tensor and its cast are alive together; the
    cast is the weight grad's saved input when the weight trains, else it dies after the
    weight multiply. They are freed before the lm_head runs, which decides which cached block
    the lm_head's and the loss's tensors reuse (the allocator simulator's order)."""
    d = layer.dims
    B, h = d["b"] * d["s"], d["h"]
    if not (need_in or need_w):
        return Acts()
    sv = Saved()
    if d.get("gemma"):
        # Gemma2RMSNorm: the weight multiply runs in fp32 (`gemma_norm_saved`); its fp32 output
        # and, unless the weight trains, the fp32 normalised tensor are transient, with the
        # `.type_as` cast as the lm_head's input
        gemma_norm_saved(sv, c, B, h, need_in, need_w)
        fwd_parts = ((t(B * h, FP32),) if c.stream != FP32 else ()) + (
            (t(B * h, FP32),) if not need_w else ())
        return Acts(saved=sv.total, parts=tuple(sv.sizes), fwd_extra=sum(fwd_parts),
                    fwd_parts=fwd_parts, bwd_extra=2 * t(B * h, c.stream))
    _norm_saved(sv, c, B, h, need_in, need_w)
    if c.liger:
        # Liger: Y is the only new forward tensor (counted by the lm_head, its one reader);
        # backward: dX written into dY (in place), `_dW` partials (sm_count, H) fp32
        dw = (t(LIGER_SM_COUNT * h, FP32),) if need_w else ()
        return Acts(saved=sv.total, parts=tuple(sv.sizes),
                    bwd_extra=t(B * h, c.stream) + sum(dw),
                    bwd_parts=(t(B * h, c.stream), *dw))
    fwd_parts = ((t(B * h, FP32),) if c.stream != FP32 else ()) + (
        (t(B * h, c.stream),) if not need_w else ())
    bwd_extra, bwd_parts = 2 * t(B * h, c.stream), ()
    if (c.cce and c.stream != FP32) or c.score_head:
        # the fp32 chain of its backward (`x * rsqrt(x.pow(2).mean(-1) + eps)`: the rsqrt
        # product's grad, mean's expand, pow's `2 * x` and its products: five B x h fp32 at its
        # top, trace tier tiny-llama bf16). Without CCE the loss's backward is the higher point;
        # counted where no vocabulary-sized backward comes first (CCE's; the reward model's
        # (hidden, 1) score head, TRL RewardTrainer, whose fp32 stream makes the same five)
        # and leaves it the step's top
        bwd_parts = (t(B * h, FP32),) * 5
        bwd_extra = sum(bwd_parts)
    return Acts(saved=sv.total, parts=tuple(sv.sizes), fwd_extra=sum(fwd_parts),
                fwd_parts=fwd_parts, bwd_extra=bwd_extra, bwd_parts=bwd_parts)


def lm_head(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """Output projection + ForCausalLMLoss: `logits.float()` then cross_entropy.

    Saved: the head's input (weight grad) and log_softmax's fp32 output (B x V). Forward
    transient: the logits (compute dtype) and their fp32 upcast, alive while log_softmax writes
    its output. Backward: nll_loss's grad (B x V fp32) and log_softmax's grad input (fp32)
    coexist, then the cast back to the compute dtype, then the head's input grad.
    """
    d = layer.dims
    B, h, V = d["b"] * d["s"], d["h"], d["vocab"]
    lora = bool(layer.lora)
    active = need_in or need_w or lora
    if not active:
        return Acts()
    e = c.e
    if c.head is not None:  # a technique's own head (Liger, CCE: `techniques.head_of`)
        return technique_head(d, c, need_in, need_w)
    if c.trl_head:  # TRL's fused, chunked head (objectives.fused_head)
        from hybridmem.families.common.objective_acts import trl_fused_head

        return trl_fused_head(layer, c, need_in, need_w)
    from hybridmem.objectives import REGISTRY

    if not REGISTRY[c.objective].LM_LOSS:  # a TRL trainer's loss on the logits (objective_acts)
        from hybridmem.families.common.objective_acts import objective_head

        return objective_head(layer, c, need_in, need_w)
    sv = Saved()
    n_lora = len(lora_matrices(layer)) // 2
    linear_inputs(sv, c, B * h, c.stream, 1, need_w, n_lora, shared=False, in_grad=need_in)
    lora_outputs(sv, c, B, n_lora)
    dora_saved(sv, c, B, dora_linears(layer), need_in)
    cap = bool(d.get("final_softcap"))
    # Gemma 2's final-logit softcap (Gemma2ForCausalLM.forward: `tanh(logits / cap) * cap`):
    # tanh saves its output (compute dtype); the division and the multiply make new tensors
    sv.add(B * V, e, cond=cap)
    sv.add(B * V, FP32)  # log_softmax output
    sv.add(B, INT64)     # shift_labels (`labels[..., 1:].contiguous()`), nll_loss's target
    sv.add(1, FP32, times=2)  # nll_loss output and total_weight
    copies = cache = 0
    if c.autocast:  # half weights under autocast: only the fp32 adapters are cast
        w = t(V * h, 2) if c.amp else 0
        copies = (w if need_in or need_w else 0) + sum(t(p.numel, 2) for p in lora_matrices(layer))
        cache = (w if need_w else 0) + sum(t(p.numel, 2) for p in lora_matrices(layer))
    if c.ce_chunks:
        return chunked_head(d, c, sv, copies, cache, need_in, need_w)
    fwd_parts = (t(B * V, e), *([t(B * V, FP32)] if e != FP32 else []))
    # the backward's three stages (docstring): the loss's two (the larger sets the transient)
    # run before the head's weight grad exists, so they are the first stage of a two-stage
    # backward (`bwd_mlp`; estimate.price gives lm_head grad_mlp = (0, grad)), the head's
    # matmuls, which make that grad, the second
    loss_parts = max(([t(B * V, FP32)] * 2,
                      [t(B * V, FP32)] + ([t(B * V, e)] if e != FP32 else [])), key=sum)
    bwd_parts = [t(B * V, e), t(B * h, e)] + ([t(V * h, 2)] if c.amp and need_w else [])
    if cap:  # the softcap's backward: tanh_backward's grad beside the incoming one
        bwd_parts = max(bwd_parts, [t(B * V, e)] * 2, key=sum)
    return Acts(saved=sv.total + copies, parts=(copies, *sv.sizes),
                cache=cache, fwd_extra=sum(fwd_parts), bwd_extra=sum(bwd_parts),
                bwd_mlp=sum(loss_parts), bwd_mlp_parts=tuple(loss_parts),
                fwd_parts=fwd_parts, bwd_parts=tuple(bwd_parts))


def chunked_head(d: dict, c: Ctx, sv: Saved, copies: int, cache: int, need_in: bool,
                 need_w: bool) -> Acts:
    """lm_head + torchtune's `CEWithChunkedOutputLoss` over `c.ce_chunks` chunks of the
    sequence (`h.chunk(N, dim=1)`, sizes `torch_chunks`; hybridmem.techniques.kernels).

    `sv` holds the head's saved input (per chunk, the same bytes as one projection); the
    chunks' log_softmax outputs (fp32) are saved in place of the single (B x V) one, and each
    chunk's `.float()` copy dies after its log_softmax. Forward high point: all N logits chunks
    (compute dtype, alive until the loss returns) + the last chunk's fp32 upcast. Backward:
    every chunk's loss backward runs before any projection's (autograd runs the higher sequence
    numbers first), the first of them (the last chunk) with nll_loss's and log_softmax's fp32
    grads, then its cast to the compute dtype (a projection's grad input, freed in its turn).
    """
    b, s, h, V = d["b"], d["s"], d["h"], d["vocab"]
    e = c.e
    rows = [b * n for n in torch_chunks(s, c.ce_chunks)]
    parts = list(sv.sizes)
    ls = [t(r * V, FP32) for r in rows]
    idx = parts.index(t(b * s * V, FP32))  # HF's single log_softmax output -> one per chunk
    parts[idx:idx + 1] = ls
    if c.amp and need_in and not need_w:
        # a frozen weight's autocast cast is not cached: each chunk's projection saves its own
        copies += (len(rows) - 1) * t(V * h, 2)
    saved = sum(parts) + copies
    logits = [t(r * V, e) for r in rows]
    last = rows[-1]
    fwd_parts = (*logits, *([t(last * V, FP32)] if e != FP32 else []))
    bwd_parts = max(([t(last * V, FP32)] * 2,
                     [t(last * V, FP32)] + ([t(last * V, e)] if e != FP32 else [])), key=sum)
    return Acts(saved=saved, parts=(copies, *parts), cache=cache, fwd_extra=sum(fwd_parts),
                bwd_extra=sum(bwd_parts), fwd_parts=fwd_parts, bwd_parts=tuple(bwd_parts))


def technique_head(d: dict, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """The lm_head + loss as a technique states them (`head_tensors(dims, ctx, need_in,
    need_w)`: what it keeps for backward, its forward's and its backward's high points beside
    them, the kept weight grad that becomes `.grad`), each tensor rounded as the allocator
    rounds it."""
    ts = c.head.head_tensors(d, c, need_in, need_w)
    saved, fwd, bwd, grad = ([t(n, size) for n, size in ts.get(k, ())]
                             for k in ("saved", "fwd", "bwd", "grad_in_saved"))
    return Acts(saved=sum(saved), parts=tuple(saved), fwd_extra=sum(fwd), fwd_parts=tuple(fwd),
                bwd_extra=sum(bwd), bwd_parts=tuple(bwd), grad_in_saved=sum(grad))


def embedding(layer: Layer, c: Ctx, need_in: bool, need_w: bool, tied_grad: int = 0,
              merged: bool = False) -> Acts:
    """Token embedding: saves only the ids (a batch input). Backward of a tied weight makes a
    second grad buffer before accumulating into the existing one. Frozen under checkpointing,
    its output is a grad-requiring leaf (see `vision_embeddings`) that gets a .grad; it is kept
    anyway as the first layer's checkpointed input, unless image features were `merged` into a
    new tensor (LLaVA), which leaves the leaf as an extra tensor."""
    d = layer.dims
    B, h = d["b"] * d["s"], d["h"]
    leaf = t(B * h, c.stream) if c.ckpt and not need_w else 0
    return Acts(saved=leaf if merged else 0, fwd_extra=2 * t(B * h, c.stream),
                bwd_extra=(tied_grad if need_w else 0) + leaf)


def rotary(layer: Layer, c: Ctx, active: bool) -> Acts:
    """cos/sin (1, s, head_dim) in the stream dtype (`position_ids` is one arange row shared by
    the batch): computed once per forward, saved by every layer's RoPE."""
    d = layer.dims
    if not active:
        return Acts()
    # under eager, Gemma builds a float mask per layer type present (causal, sliding window),
    # b x 1 x s x s in the embeddings' dtype each (masking_utils `create_causal_mask` /
    # `create_sliding_window_causal_mask`, eager: `eager_mask`), held by the model's forward
    # until it returns (`held`: released at the forward's end)
    mask = t(d["b"] * d["s"] * d["s"], c.stream)
    masks = d.get("mask_types", 0) * mask if c.attn == "eager" else 0
    # SDPA (Gemma 3): the sliding mask, once built (`sliding_masked`), is an input SDPA saves
    # in every sliding layer: alive until the last of them ran backward, as cos/sin
    sdpa_mask = mask if c.attn == "sdpa" and d.get("sliding_masked") else 0
    if d.get("image_masks") and c.attn == "sdpa":  # Gemma 3 VLM with images: per-layer masks
        sdpa_mask, masks = image_bool_masks(d, c)
    # one cos/sin pair per RoPE table (Gemma 3: the local and the global base)
    return Acts(saved=2 * d.get("rope_tables", 1) * t(d["s"] * d["head_dim"], c.stream)
                + sdpa_mask, held=masks)


VLM_MASKS = 2
"""`create_masks_for_vision_model` returns a full and a sliding mask whatever layer types the
LM has (modeling_gemma3.py: Gemma 3's LM on a batch with images, `dims["image_masks"]`)."""


def image_mask_saved(d: dict, c: Ctx) -> int:
    """One decoder layer's SDPA on the VLM's bool mask (`model.image_masks`): torch
    converts it per call to an additive mask in the query dtype over its (b, 1, s, s) shape
    (attention.cpp `convert_boolean_attn_mask`), which the kernel saves for its backward."""
    if not d.get("image_masks") or c.attn != "sdpa":
        return 0
    return t(d["b"] * d["s"] * d["s"], c.e)


def image_bool_masks(d: dict, c: Ctx) -> tuple[int, int]:
    """(saved, held) of the VLM's two (b, 1, s, s) bool masks: the model's forward holds them
    until it returns; under checkpointing every layer's recompute reads them again, so they
    stay until the backward is through the LM (priced at the rotary layer, the LM's first)."""
    masks = VLM_MASKS * t(d["b"] * d["s"] * d["s"], 1)
    return (masks, 0) if c.ckpt else (0, masks)
