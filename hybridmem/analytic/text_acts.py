"""Activation formulas of the decoder LLM: Llama/Mistral/Qwen2 layers, final norm, lm_head
with the loss, token embedding, rotary tables (sources: `hybridmem.analytic.activations`)."""

from __future__ import annotations

from hybridmem.analytic.activations import (
    FP32, INT64, Acts, Ctx, Saved, adapters_on, amp_copies, attention_core, dora_forward,
    dora_linears, dora_saved, linear_inputs, lora_matrices, lora_outputs,
)
from hybridmem.analytic.alloc import t
from hybridmem.models.graph import Layer


def decoder_layer(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """Llama/Mistral/Qwen2 decoder layer: RMSNorm, GQA attention with RoPE, SwiGLU MLP."""
    d = layer.dims
    b, s, h, f = d["b"], d["s"], d["h"], d["ffn"]
    B, qd, kvd = b * s, d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    lora = bool(layer.lora)
    active = need_in or need_w or lora
    if not active or not layer.runs:
        return Acts()
    e, sb = c.e, c.stream
    sv = Saved()
    fused = bool(d.get("fused"))  # Phi-3: one qkv_proj, one gate_up_proj (decoder.FUSED_TYPES)
    QKV, GU = ("q_proj", "k_proj", "v_proj", "qkv_proj"), ("gate_proj", "up_proj", "gate_up_proj")
    n_qkv = adapters_on(layer, QKV)
    n_o, n_gu = adapters_on(layer, ("o_proj",)), adapters_on(layer, GU)
    n_down = adapters_on(layer, ("down_proj",))
    # input RMSNorm: fp32 input (or upcast copy), rsqrt; normalised input for the weight grad
    sv.add(B * h, FP32, need_in)
    sv.add(B, FP32, need_in)
    sv.add(B * h, sb, need_w)
    linear_inputs(sv, c, B * h, sb, 1 if fused else 3, need_w, n_qkv, shared=False,
                  in_grad=need_in)
    lora_outputs(sv, c, B, n_qkv)
    dora_saved(sv, c, B, dora_linears(layer, QKV), need_in)
    if d.get("qk_norm"):
        for proj, width, rows in (("q_proj", qd, d["heads"]), ("k_proj", kvd, d["kv_heads"])):
            grad = need_in or need_w or adapters_on(layer, (proj,)) > 0
            head_norm(sv, c, B, width, rows, grad, need_w)
    probs = attention_core(sv, c, b, s, d["heads"], qd, kvd,
                           qkv=B * (qd + 2 * kvd) if fused else 0)
    # o_proj input: eager's transpose(1,2).contiguous() copy; SDPA/flash output is reused
    linear_inputs(sv, c, B * qd, e, 1, need_w, n_o, shared=c.attn != "eager",
                  in_grad=need_in or n_qkv > 0)
    lora_outputs(sv, c, B, n_o)
    dora_saved(sv, c, B, dora_linears(layer, ("o_proj",)), True)
    attn_part = sv.total
    # post-attention RMSNorm on the residual h1 (always on the grad path once active)
    sv.add(B * h, FP32)
    sv.add(B, FP32)
    sv.add(B * h, sb, need_w)
    linear_inputs(sv, c, B * h, sb, 1 if fused else 2, need_w, n_gu, shared=False)
    lora_outputs(sv, c, B, n_gu)
    dora_saved(sv, c, B, dora_linears(layer, GU), True)
    # gate output (SiLU input), SiLU output, up output (mul operands); fused: gate and up are
    # `chunk` views of one B x 2f output, the same bytes
    sv.add(B * f, e, times=3)
    linear_inputs(sv, c, B * f, e, 1, need_w, n_down, shared=False)
    lora_outputs(sv, c, B, n_down)
    dora_saved(sv, c, B, dora_linears(layer, ("down_proj",)), True)
    copies, cache = amp_copies(layer, c, active, need_w)
    # forward transients: RoPE's rotated q, k (fp32 under autocast), eager's two probs casts
    rope_parts = [t(B * qd, FP32), t(B * kvd, FP32)] if c.amp else [t(B * qd, e)] * 2
    fwd_parts = (*rope_parts, *[t(probs, e)] * (2 if probs else 0))
    dora = dora_forward(c, dora_linears(layer))
    fwd_parts = dora if sum(dora) > sum(fwd_parts) else fwd_parts  # not alive together
    # backward: the grad of the layer output, then in the MLP grad(m) with grad(act), grad(up)
    # (m itself is freed once down_proj's backward ran); in attention dq, dk, dv.
    mlp_bwd = 2 * t(B * f, e)
    attn_bwd = 3 * t(B * qd, e) + (t(probs, FP32) + t(probs, e) if probs else 0)
    qkv_out = qd + 2 * kvd if fused else qd  # widest attention-input linear's output
    if fused:
        # q/k/v are slices of one output: each slice's backward (`slice_backward`) makes a
        # zero-filled full-size grad, added into autograd's input buffer of the fused output
        attn_bwd += 2 * t(B * qkv_out, e)
    if not c.amp and e != FP32:
        # the fp32 adapter branch: its output grad is cast to fp32 (B x out) and lora_A returns
        # an fp32 input grad (B x in) before the cast back (PEFT lora.Linear in bf16 models)
        if n_gu or n_down:
            mlp_bwd += t(B * f * (2 if fused else 1), FP32) + t(B * h, FP32)
        if n_qkv or n_o:
            attn_bwd += t(B * qkv_out, FP32) + t(B * h, FP32)
    elif c.amp:
        # autocast: lora_A's bf16 input grad is cast back to the fp32 stream (B x in)
        mlp_bwd += t(B * h, FP32) if (n_gu or n_down) else 0
        attn_bwd += t(B * h, FP32) if (n_qkv or n_o) else 0
    if c.attn == "flash_attention_2":
        attn_bwd += t(B * qd, FP32)  # dq_accum (fp32) inside flash-attn backward
    probs_parts = [t(probs, FP32), t(probs, e)] if probs else []
    return Acts(saved=sv.total + copies, parts=(copies, *sv.sizes),
                ckpt_saved=t(B * h, sb), cache=cache, fwd_extra=sum(fwd_parts),
                bwd_extra=2 * t(B * h, sb) + attn_bwd, mlp_saved=sv.total - attn_part,
                bwd_mlp=t(B * h, sb) + mlp_bwd,
                fwd_parts=fwd_parts,
                bwd_parts=(t(B * h, sb), t(B * h, sb), *[t(B * qd, e)] * 3, *probs_parts),
                bwd_mlp_parts=(t(B * h, sb), t(B * f, e), t(B * f, e)))


def head_norm(sv: Saved, c: Ctx, tokens: int, width: int, rows: int, grad: bool,
              need_w: bool) -> None:
    """Qwen3's q_norm / k_norm (`Qwen3RMSNorm(head_dim)` on the projection's output viewed as
    tokens x heads x head_dim; modeling_qwen3.Qwen3RMSNorm.forward): `.to(float32)` (a copy in
    bf16, the projection's output itself in fp32) saved by `pow` and the rsqrt mul, the rsqrt
    (one fp32 per head row), and the normalised tensor cast back to the projection's dtype,
    saved by `weight * x` for the weight's grad. `grad`: the projection's output requires grad."""
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
    sv.add(B * h, FP32, need_in)
    sv.add(B, FP32, need_in)
    sv.add(B * h, c.stream, need_w)
    fwd_parts = ((t(B * h, FP32),) if c.stream != FP32 else ()) + (
        (t(B * h, c.stream),) if not need_w else ())
    return Acts(saved=sv.total, parts=tuple(sv.sizes), fwd_extra=sum(fwd_parts),
                fwd_parts=fwd_parts, bwd_extra=2 * t(B * h, c.stream))


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
    sv = Saved()
    n_lora = len(lora_matrices(layer)) // 2
    linear_inputs(sv, c, B * h, c.stream, 1, need_w, n_lora, shared=False, in_grad=need_in)
    lora_outputs(sv, c, B, n_lora)
    dora_saved(sv, c, B, dora_linears(layer), need_in)
    sv.add(B * V, FP32)  # log_softmax output
    sv.add(B, INT64)     # shift_labels (`labels[..., 1:].contiguous()`), nll_loss's target
    sv.add(1, FP32, times=2)  # nll_loss output and total_weight
    copies = cache = 0
    if c.amp:
        w = t(V * h, 2)
        copies = (w if need_in or need_w else 0) + sum(t(p.numel, 2) for p in lora_matrices(layer))
        cache = (w if need_w else 0) + sum(t(p.numel, 2) for p in lora_matrices(layer))
    fwd_parts = (t(B * V, e), *([t(B * V, FP32)] if e != FP32 else []))
    # the backward's three stages (docstring): the loss's two (the larger sets the transient)
    # run before the head's weight grad exists, so they are the first stage of a two-stage
    # backward (`bwd_mlp`; estimate.price gives lm_head grad_mlp = (0, grad)), the head's
    # matmuls, which make that grad, the second
    loss_parts = max(([t(B * V, FP32)] * 2,
                      [t(B * V, FP32)] + ([t(B * V, e)] if e != FP32 else [])), key=sum)
    bwd_parts = [t(B * V, e), t(B * h, e)] + ([t(V * h, 2)] if c.amp and need_w else [])
    return Acts(saved=sv.total + copies, parts=(copies, *sv.sizes),
                cache=cache, fwd_extra=sum(fwd_parts), bwd_extra=sum(bwd_parts),
                bwd_mlp=sum(loss_parts), bwd_mlp_parts=tuple(loss_parts),
                fwd_parts=fwd_parts, bwd_parts=tuple(bwd_parts))


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
    return Acts(saved=2 * t(d["s"] * d["head_dim"], c.stream))
