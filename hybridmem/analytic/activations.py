"""Activations saved for backward, and the short-lived tensors around them, per layer.

Each formula lists the tensors autograd keeps, op by op, for the transformers 5.x modules
(`modeling_llama.py` RMSNorm/attention/MLP, `modeling_clip.py` encoder layer, `modeling_llava.py`
projector, `loss_utils.ForCausalLMLoss`) and the PyTorch derivative formulas
(`tools/autograd/derivatives.yaml`): a Linear saves its input only if its weight needs a grad
and its weight only if its input does; a mul by a tensor saves the other operand; RMSNorm keeps
its fp32 input and rsqrt; LayerNorm its input, mean and rstd (fp32); SiLU/GELU their input;
softmax its output; SDPA/flash its q, k, v, output and fp32 logsumexp.

Dtypes: pure precisions run in the parameter dtype. Under autocast (`*-mixed`) params are fp32,
linears/SDPA run in bf16/fp16 on cast copies (autograd saves the copies; casts of trainable leaf
weights sit in the autocast cache until autocast exits), while embeddings, residual adds
(fp32 + bf16 promotes), norms and RoPE (fp32 cos/sin) keep the residual stream in fp32.
LoRA (PEFT `lora.Linear.forward`): `_cast_input_dtype` casts the input to the fp32 adapter dtype
(a saved copy when the model runs in bf16), lora_A's output is saved by lora_B.

Tokens: B = micro_batch x seq (language model), N = crops x tokens per crop (vision tower).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmem.analytic.alloc import t
from hybridmem.models.graph import Layer

FP32 = 4
INT64 = 8
LSE_ALIGN_EFFICIENT = 32  # mem-efficient SDPA pads logsumexp rows to 32 (kAlignLSE)
# Ops that keep two inputs of the activation in memory (x * sigmoid(1.702 x)): quick_gelu.
TWO_TENSOR_ACTS = frozenset({"quick_gelu"})


@dataclass(frozen=True, slots=True)
class Ctx:
    """How a step runs: dtypes of matmul outputs and of the residual stream, attention kernel."""

    e: int
    """Bytes per element of matmul/attention outputs (autocast dtype, or param dtype)."""
    stream: int
    """Bytes per element of the residual stream (fp32 under autocast, else the param dtype)."""
    amp: bool
    attn: str
    lora_r: int = 0
    lora_dropout: float = 0.0
    ckpt: bool = False


@dataclass(frozen=True, slots=True)
class Acts:
    """Activation bytes of one layer over a step."""

    saved: int = 0
    """Saved for backward without checkpointing (incl. autocast weight copies)."""
    ckpt_saved: int = 0
    """Saved when the layer is checkpointed (its input)."""
    cache: int = 0
    """Autocast-cached bf16 copies of trainable weights: live until the forward ends."""
    fwd_extra: int = 0
    """Transient on top of `saved` while the layer runs forward."""
    bwd_extra: int = 0
    """Transient on top of `saved` while the layer runs backward (grads of activations)."""
    mlp_saved: int = 0
    """Part of `saved` that the MLP holds: freed before the attention's backward runs."""
    bwd_mlp: int = 0
    """Transient of the MLP's backward (the first half of a transformer layer's backward);
    0: the layer's backward is one stage with `bwd_extra`."""
    held: int = 0
    """Outputs the model's return value holds (`image_outputs`) until the forward returns."""


class _Saved:
    def __init__(self) -> None:
        self.total = 0

    def add(self, numel: int, itemsize: int, cond: bool = True, times: int = 1) -> None:
        if cond:
            self.total += times * t(numel, itemsize)


def _adapters(layer: Layer, names: tuple[str, ...]) -> int:
    """How many of the named linears of this layer carry LoRA adapters."""
    return sum(1 for p in layer.lora if "lora_A" in p.name and p.name.split(".lora_A")[0]
               .split(".")[-1] in names)


def _linear_inputs(sv: _Saved, c: Ctx, numel: int, in_bytes: int, n_base: int, base_w: bool,
                   adapters: int, shared: bool) -> None:
    """Inputs saved by `n_base` linears reading one tensor of `numel` elements.

    `shared`: the tensor itself is already saved by another op (no new memory when saved again).
    Under autocast each linear casts an fp32 input separately (one saved copy per linear).
    """
    dropout = c.lora_dropout > 0
    # LoRA dropout (nn.Dropout before lora_A) saves a bool mask per adapter and hands lora_A a
    # new tensor; without it PEFT uses nn.Identity
    sv.add(numel, 1, times=adapters if dropout else 0)
    if c.amp:
        cast = in_bytes != 2
        if base_w:
            sv.add(numel, 2, times=n_base if cast else 1, cond=cast or not shared)
        sv.add(numel, 2, times=adapters)  # PEFT casts to fp32, autocast back: a new copy each
    else:
        sv.add(numel, in_bytes, cond=base_w and not shared)
        if adapters:
            if in_bytes == FP32 and not dropout:
                sv.add(numel, FP32, cond=not base_w and not shared)
            else:  # `_cast_input_dtype` fp32 copy (or dropout output) per adapter
                sv.add(numel, FP32, times=adapters)


def _lora_outputs(sv: _Saved, c: Ctx, tokens: int, adapters: int) -> None:
    sv.add(tokens * c.lora_r, 2 if c.amp else FP32, times=adapters)


def _linear_weights(layer: Layer) -> int:
    return sum(p.numel for p in layer.params if len(p.shape) == 2 or p.name.endswith("bias"))


def _amp_copies(layer: Layer, c: Ctx, active: bool, need_w: bool) -> tuple[int, int]:
    """(saved, cached) bytes of bf16 weight copies under autocast."""
    if not c.amp or not active:
        return 0, 0
    base = t(_linear_weights(layer), 2) if layer.params else 0
    lora = sum(t(p.numel, 2) for p in layer.lora)
    return base + lora, (base if need_w else 0) + lora


def _attention_core(sv: _Saved, c: Ctx, b: int, s: int, heads: int, qd: int, kvd: int) -> int:
    """Saved q/k/v/out(+lse or probs) of one attention; returns the eager probs size (b·a·s²)."""
    B = b * s
    e = c.e
    probs = b * heads * s * s
    if c.attn == "eager":
        rep = qd  # repeat_kv materialises k and v at all heads when kv_heads < heads
        k_el = rep if kvd < qd else kvd
        sv.add(B * qd, e)       # q (cast copy under autocast)
        sv.add(B * k_el, e)     # k (repeated)
        sv.add(probs, FP32)     # softmax(dtype=float32) output
        sv.add(probs, e, cond=e != FP32)  # .to(q.dtype) / autocast cast, saved by probs @ v
        sv.add(B * k_el, e)     # v (repeated)
        return probs
    sv.add(B * qd, e)
    sv.add(B * kvd, e, times=2)
    sv.add(B * qd, e)           # output
    rows = s if (e != FP32 or c.attn == "flash_attention_2") else -(-s // LSE_ALIGN_EFFICIENT) * LSE_ALIGN_EFFICIENT
    sv.add(b * heads * rows, FP32)  # logsumexp
    return 0


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
    sv = _Saved()
    n_qkv = _adapters(layer, ("q_proj", "k_proj", "v_proj"))
    n_o, n_gu = _adapters(layer, ("o_proj",)), _adapters(layer, ("gate_proj", "up_proj"))
    n_down = _adapters(layer, ("down_proj",))
    # input RMSNorm: fp32 input (or upcast copy), rsqrt; normalised input for the weight grad
    sv.add(B * h, FP32, need_in)
    sv.add(B, FP32, need_in)
    sv.add(B * h, sb, need_w)
    _linear_inputs(sv, c, B * h, sb, 3, need_w, n_qkv, shared=False)
    _lora_outputs(sv, c, B, n_qkv)
    probs = _attention_core(sv, c, b, s, d["heads"], qd, kvd)
    # o_proj input: eager's transpose(1,2).contiguous() copy; SDPA/flash output is reused
    _linear_inputs(sv, c, B * qd, e, 1, need_w, n_o, shared=c.attn != "eager")
    _lora_outputs(sv, c, B, n_o)
    attn_part = sv.total
    # post-attention RMSNorm on the residual h1 (always on the grad path once active)
    sv.add(B * h, FP32)
    sv.add(B, FP32)
    sv.add(B * h, sb, need_w)
    _linear_inputs(sv, c, B * h, sb, 2, need_w, n_gu, shared=False)
    _lora_outputs(sv, c, B, n_gu)
    sv.add(B * f, e, times=3)  # gate output (SiLU input), SiLU output, up output (mul operands)
    _linear_inputs(sv, c, B * f, e, 1, need_w, n_down, shared=False)
    _lora_outputs(sv, c, B, n_down)
    copies, cache = _amp_copies(layer, c, active, need_w)
    rope = t(B * qd, FP32) + t(B * kvd, FP32) if c.amp else 2 * t(B * qd, e)
    fwd = rope + (2 * t(probs, e) if probs else 0)
    # backward: the grad of the layer output, then in the MLP grad(m) with grad(act), grad(up)
    # (m itself is freed once down_proj's backward ran); in attention dq, dk, dv.
    mlp_bwd = 2 * t(B * f, e)
    attn_bwd = 3 * t(B * qd, e) + (t(probs, FP32) + t(probs, e) if probs else 0)
    if not c.amp and e != FP32:
        # the fp32 adapter branch: its output grad is cast to fp32 (B x out) and lora_A returns
        # an fp32 input grad (B x in) before the cast back (PEFT lora.Linear in bf16 models)
        if n_gu or n_down:
            mlp_bwd += t(B * f, FP32) + t(B * h, FP32)
        if n_qkv or n_o:
            attn_bwd += t(B * qd, FP32) + t(B * h, FP32)
    elif c.amp:
        # autocast: lora_A's bf16 input grad is cast back to the fp32 stream (B x in)
        mlp_bwd += t(B * h, FP32) if (n_gu or n_down) else 0
        attn_bwd += t(B * h, FP32) if (n_qkv or n_o) else 0
    if c.attn == "flash_attention_2":
        attn_bwd += t(B * qd, FP32)  # dq_accum (fp32) inside flash-attn backward
    return Acts(saved=sv.total + copies, ckpt_saved=t(B * h, sb), cache=cache, fwd_extra=fwd,
                bwd_extra=2 * t(B * h, sb) + attn_bwd, mlp_saved=sv.total - attn_part,
                bwd_mlp=t(B * h, sb) + mlp_bwd)


def encoder_layer(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """CLIP/SigLIP encoder layer: LayerNorm, bidirectional attention with biases, fc1-act-fc2."""
    d = layer.dims
    N, h, f, heads = d["n"] * d["t"], d["h"], d["ffn"], d["heads"]
    active = need_in or need_w
    if not active or not layer.runs:
        return Acts()
    e, sb = c.e, c.stream
    sv = _Saved()
    sv.add(N * h, sb)                 # LayerNorm input
    sv.add(d["n"] * d["t"], FP32, times=2)  # mean, rstd
    _linear_inputs(sv, c, N * h, sb, 3, need_w, 0, shared=False)
    probs = _attention_core(sv, c, d["n"], d["t"], heads, h, h)
    _linear_inputs(sv, c, N * h, e, 1, need_w, 0, shared=c.attn != "eager")
    attn_part = sv.total
    sv.add(N * h, sb)                 # second LayerNorm input (residual)
    sv.add(N, FP32, times=2)
    _linear_inputs(sv, c, N * h, sb, 1, need_w, 0, shared=False)
    two = d["act"] in TWO_TENSOR_ACTS
    sv.add(N * f, e, times=2 if two else 1)  # activation input (+ sigmoid output)
    sv.add(N * f, e, need_w)          # fc2 input
    copies, cache = _amp_copies(layer, c, active, need_w)
    fwd = (t(N * f, e) if two else 0) + (2 * t(probs, e) if probs else 0)
    attn_bwd = 3 * t(N * h, e) + (t(probs, FP32) + t(probs, e) if probs else 0)
    return Acts(saved=sv.total + copies, ckpt_saved=t(N * h, sb), cache=cache, fwd_extra=fwd,
                bwd_extra=2 * t(N * h, sb) + attn_bwd, mlp_saved=sv.total - attn_part,
                bwd_mlp=t(N * h, sb) + 2 * t(N * f, e))


def layernorm(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """A vision LayerNorm (pre_layrnorm): input, mean, rstd.

    `post_layernorm` pools the first token of the last hidden state; LLaVA never uses it, but
    the returned `image_outputs` holds the last hidden state and the pooled output until the
    forward returns (the LayerNorm's saved input is a view of that same last hidden state)."""
    d = layer.dims
    N = d["n"] * d["t"]
    if layer.name == "post_layernorm":
        if not layer.runs:
            return Acts()
        return Acts(held=t(N * d["h"], c.stream) + t(d["n"] * d["h"], c.stream))
    if not (need_in or need_w) or not layer.runs:
        return Acts()
    saved = t(N * d["h"], c.stream) + 2 * t(N, FP32)
    return Acts(saved=saved, fwd_extra=0, bwd_extra=2 * t(N * d["h"], c.stream))


def rmsnorm(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """Final RMSNorm: fp32 input, rsqrt; normalised input for the weight grad."""
    d = layer.dims
    B, h = d["b"] * d["s"], d["h"]
    if not (need_in or need_w):
        return Acts()
    sv = _Saved()
    sv.add(B * h, FP32, need_in)
    sv.add(B, FP32, need_in)
    sv.add(B * h, c.stream, need_w)
    return Acts(saved=sv.total, bwd_extra=2 * t(B * h, c.stream))


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
    sv = _Saved()
    _linear_inputs(sv, c, B * h, c.stream, 1, need_w, len(layer.lora) // 2, shared=False)
    _lora_outputs(sv, c, B, len(layer.lora) // 2)
    sv.add(B * V, FP32)  # log_softmax output
    sv.add(B, INT64)     # shift_labels (`labels[..., 1:].contiguous()`), nll_loss's target
    sv.add(1, FP32, times=2)  # nll_loss output and total_weight
    copies = cache = 0
    if c.amp:
        w = t(V * h, 2)
        copies = (w if need_in or need_w else 0) + sum(t(p.numel, 2) for p in layer.lora)
        cache = (w if need_w else 0) + sum(t(p.numel, 2) for p in layer.lora)
    fwd = t(B * V, e) + (t(B * V, FP32) if e != FP32 else 0)
    bwd = max(2 * t(B * V, FP32),
              t(B * V, FP32) + (t(B * V, e) if e != FP32 else 0),
              t(B * V, e) + t(B * h, e) + (t(V * h, 2) if c.amp and need_w else 0))
    return Acts(saved=sv.total + copies, cache=cache, fwd_extra=fwd, bwd_extra=bwd)


def projector(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """mlp2x_gelu: linear_1 (saves its folded input), GELU (saves input), linear_2."""
    d = layer.dims
    N, d_in, h = d["n"] * d["t"], d["d_in"], d["h"]
    if not layer.runs or N == 0:
        return Acts()
    if not (need_in or need_w):
        return Acts(held=t(N * h, c.e) + t(d.get("packed", 0) * h, c.e))
    e = c.e
    sv = _Saved()
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
    return Acts(saved=sv.total + copies, cache=cache, fwd_extra=t(N * h, c.stream),
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


def image_merge(b: int, s: int) -> int:
    """`masked_scatter` of image features saves the (b, s, 1) bool mask."""
    return t(b * s, 1)
