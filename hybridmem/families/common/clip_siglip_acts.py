"""Activation formulas of the vision side: CLIP/SigLIP encoder layers and LayerNorms, patch
embeddings, the LLaVA projector (sources: `hybridmem.families.common.activations`)."""

from __future__ import annotations

from hybridmem.families.common.activations import (
    FP32, TWO_TENSOR_ACTS, Acts, Ctx, Saved, amp_copies, attention_core, linear_inputs,
)
from hybridmem.allocator.alloc import t
from hybridmem.families.common.eager_top import backward_top, forward_top
from hybridmem.models.graph import Layer


def encoder_layer(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """CLIP/SigLIP encoder layer: LayerNorm, bidirectional attention with biases, fc1-act-fc2."""
    d = layer.dims
    N, h, f, heads = d["n"] * d["t"], d["h"], d["ffn"], d["heads"]
    active = need_in or need_w
    if not active or not layer.runs:
        return Acts()
    e, sb = c.e, c.stream
    # the LayerNorms' outputs: fp32 under any autocast (CUDA's fp32 list has layer_norm,
    # autocast_mode.cpp), so each linear reading one casts its own copy
    ln = FP32 if c.autocast else sb
    sv = Saved()
    sv.add(N * h, sb)                 # LayerNorm input
    sv.add(N, FP32, times=2)          # mean, rstd
    linear_inputs(sv, c, N * h, ln, 3, need_w, 0, shared=False)
    probs = attention_core(sv, c, d["n"], d["t"], heads, h, h)
    at_probs, before_o = sv.total - (t(probs, e) if c.amp else 0), sv.total
    linear_inputs(sv, c, N * h, e, 1, need_w, 0, shared=c.attn != "eager")
    o_saved = sv.total - before_o
    attn_part = sv.total
    sv.add(N * h, sb)                 # second LayerNorm input (residual)
    sv.add(N, FP32, times=2)
    linear_inputs(sv, c, N * h, ln, 1, need_w, 0, shared=False)
    two = d["act"] in TWO_TENSOR_ACTS
    sv.add(N * f, e, times=2 if two else 1)  # activation input (+ sigmoid output)
    sv.add(N * f, e, need_w)          # fc2 input
    copies, cache = amp_copies(layer, c, active, need_w)
    # eager (`eager_top`): no mask in the tower, the scores in the matmul dtype; beside them
    # the projections' q, k, v (modeling_clip.CLIPAttention.forward locals; matmul saves
    # contiguous copies)
    fwd_parts, after_top = forward_top(probs, e, at_probs, sv.total,
                                       tuple([t(N * f, e)] if two else []), c.ckpt, e,
                                       (t(N * h, e),) * 3)
    # backward: the grad of the layer output and its residual copy; dq, dk, dv (eager probs:
    # `eager_top.backward_top`, after out_proj's input, v and the probs cast were released)
    bwd_parts = (t(N * h, sb), t(N * h, sb), *[t(N * h, e)] * 3)
    top = backward_top(probs, e, t(N * h, sb), t(N * h, e),
                       o_saved + t(N * h, e) + (t(probs, e) if e != FP32 else 0), sum(bwd_parts))
    bwd_parts, bwd_freed = top or (bwd_parts, 0)
    bwd_mlp_parts = (t(N * h, sb), t(N * f, e), t(N * f, e))
    return Acts(saved=sv.total + copies, parts=(copies, *sv.sizes),
                ckpt_saved=t(N * h, sb), cache=cache, fwd_extra=sum(fwd_parts),
                bwd_extra=sum(bwd_parts), mlp_saved=sv.total - attn_part,
                bwd_mlp=sum(bwd_mlp_parts), fwd_parts=fwd_parts, bwd_parts=bwd_parts,
                bwd_mlp_parts=bwd_mlp_parts, fwd_after_top=after_top, bwd_top_freed=bwd_freed)


def layernorm(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """A vision LayerNorm (pre_layrnorm): input, mean, rstd.

    `post_layernorm` pools the first token of the last hidden state; LLaVA never uses it, but
    the returned `image_outputs` holds the last hidden state and the pooled output until the
    forward returns (the LayerNorm's saved input is a view of that same last hidden state)."""
    d = layer.dims
    N = d["n"] * d["t"]
    if layer.name == "post_layernorm" and d.get("feeds") and layer.runs:
        # Gemma 3: a LayerNorm on the path, its output (`last_hidden_state`) held by
        # `image_outputs` until the forward returns
        held = t(N * d["h"], c.stream)
        if not (need_in or need_w):
            return Acts(held=held)
        return Acts(saved=t(N * d["h"], c.stream) + 2 * t(N, FP32), held=held,
                    bwd_extra=2 * t(N * d["h"], c.stream))
    if layer.name == "post_layernorm":
        if not layer.runs:
            return Acts()
        return Acts(held=t(N * d["h"], c.stream) + t(d["n"] * d["h"], c.stream))
    if not (need_in or need_w) or not layer.runs:
        return Acts()
    saved = t(N * d["h"], c.stream) + 2 * t(N, FP32)
    return Acts(saved=saved, fwd_extra=0, bwd_extra=2 * t(N * d["h"], c.stream))


def projector(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """mlp2x_gelu: linear_1 (saves its folded input), GELU (saves input), linear_2."""
    d = layer.dims
    N, d_in, h = d["n"] * d["t"], d["d_in"], d["h"]
    if not layer.runs or N == 0:
        return Acts()
    if not (need_in or need_w):
        return Acts(held=t(N * h, c.e) + t(d.get("packed", 0) * h, c.e))
    e = c.e
    sv = Saved()
    sv.add(N * d_in, e, need_w)  # reshape copy of the [:, 1:] view, or autocast's cast copy
    sv.add(N * h, e)             # GELU input
    sv.add(N * h, e, need_w)     # linear_2 input
    copies = cache = 0
    if c.amp:
        w1 = t(h * d_in + h, 2)
        w2 = t(h * h + h, 2)
        copies = w2 + (w1 if need_in else 0)
        cache = (w1 + w2) if need_w else 0
    # the projector's output stays referenced by `image_outputs.pooler_output` (LLaVA-NeXT:
    # the packed per-image features instead) until the forward returns
    held = t(N * h, e) + t(d.get("packed", 0) * h, e)
    return Acts(saved=sv.total + copies, parts=(copies, *sv.sizes),
                cache=cache, fwd_extra=t(N * h, c.stream),
                bwd_extra=2 * t(N * h, e), held=held)


def vision_embeddings(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """Patch conv (+ CLS, + position embedding). The pixels are a batch input (counted there);
    autocast saves a bf16 copy of them for the conv weight grad.

    With checkpointing, transformers' `enable_input_require_grads` (called by
    `activation_checkpointing_enable` when `main_input_name == "input_ids"`) hooks every input
    embedding, the tower's patch conv included: a frozen conv's output becomes a leaf that
    requires grad, kept by its AccumulateGrad node through backward, and gets a .grad at the end.
    """
    d = layer.dims
    N, h = d["n"] * d["t"], d["h"]
    if not layer.runs or d["n"] == 0:
        return Acts()
    patches = d["n"] * (d["t"] - (1 if d["cls"] else 0)) * h
    pixels = d["n"] * d["channels"] * d["side"] ** 2
    # the conv saves its input for the weight grad: autocast's bf16 copy, or LLaVA-NeXT's
    # `torch.cat` of each image's crops (get_image_features); else the batch tensor itself
    copy = c.amp or d.get("anyres", False)
    saved = t(pixels, 2 if c.amp else c.e) if copy and need_w else 0
    leaf = t(patches, c.e) if c.ckpt and not need_w else 0
    return Acts(saved=saved + leaf, fwd_extra=t(N * h, c.e) + t(N * h, c.stream),
                bwd_extra=(t(N * h, c.stream) if need_w else 0) + leaf)
