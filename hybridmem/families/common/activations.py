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
(a saved copy when the model runs in bf16), lora_A's output is saved by lora_B. LoRA-FA
(peft `create_lorafa_optimizer`) freezes lora_A: its input (that copy, or the dropout output)
is not saved, its dropout mask only while the input needs a grad.
DoRA (peft/tuners/lora/dora.py `DoraLinearLayer.forward`, see `dora_saved` / `dora_forward`)
also saves the base output and lora_B's output for the magnitude's grad, and builds the full
weight W + scale B@A (fp32) in every forward to take its (detached) column norm.

Tokens: B = micro_batch x seq (language model), N = crops x tokens per crop (vision tower).
This module holds the shared pieces; the formulas are in `families/common/decoder_acts.py`
(decoder LLM, loss) and `families/common/clip_siglip_acts.py` (vision tower, projector).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmem.allocator.alloc import t
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
    """Bytes per element of the residual stream (fp32 under autocast over fp32 weights, else
    the param dtype)."""
    amp: bool
    """Autocast over fp32 weights (`*-mixed`, `job.precision.casts_weights`)."""
    attn: str
    autocast: bool = False
    """Any autocast, also over half weights (`bf16-autocast`): peft's fp32 adapters and their
    inputs are cast to the autocast dtype as under `amp`."""
    lora_r: int = 0
    lora_dropout: float = 0.0
    ckpt: bool = False
    dora: bool = False
    frozen_a: bool = False
    """lora_A has requires_grad=False (optimizer `lora-fa`)."""
    quant: object = None
    """`hybridmem.techniques.quantize.Quant` of a quantised base (`--quantize`), else None."""
    liger: bool = False
    """Liger's kernels replace RMSNorm, SwiGLU, RoPE and the lm_head + loss (`--liger`, on a
    model type Liger patches; `hybridmem.techniques.liger`)."""
    ce_chunks: int = 0
    """torchtune's chunked cross-entropy in N chunks (`--chunked-ce N`); 0 = HF's loss."""
    cce: bool = False
    """Cut Cross-Entropy replaces the lm_head + loss (`--cut-cross-entropy`; `techniques.cce`)."""
    head: object = None
    """A technique module whose `head_tensors` replace the lm_head + loss (`hybridmem.techniques
    .head_of`: Liger's fused preference losses), else None."""
    param: int = 4
    """Bytes per element of the parameters (Liger's FLCE weight grad has the weight's dtype)."""
    adapter: int = FP32
    """Bytes per element of the LoRA adapters (fp32: peft's default; else the weights' dtype
    in a pure run, `job.precision.check_adapters`): PEFT's `_cast_input_dtype` makes no copy
    when the input already has it."""
    score_head: bool = False
    """The lm_head is a sequence classifier's (1, hidden) `score` (the objective's `SCORE_HEAD`:
    the reward model): no vocabulary-sized backward comes before the final norm's."""
    padded: bool = False
    """The batch carries an attention mask with padding (`TrainingSpec.padded`): each sdpa
    layer saves its converted (b x s x s) mask (`analytic.objectives.padded_sdpa_mask`)."""
    objective: str = "sft"
    """The training objective (`hybridmem.objectives`): its loss replaces the LM loss at the
    head (`families.common.objective_acts`)."""
    prompt: int = 0
    """Prompt tokens per sequence the objective's loss masks out (`objectives.prompt_length`)."""
    ref_model: str = "none"
    """Where a preference objective's reference log-probs come from (`objectives.ref_model_of`)."""
    trl_head: bool = False
    """The head is TRL's fused, chunked LM head (`objectives.fused_head`, the installed TRL)."""


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
    shared: int = 0
    """Part of `saved` on storages that two ops save (RMSNorm's fp32 input: `pow` and `mul`
    both save self, tools/autograd/derivatives.yaml): TRL's activation offloading offloads a
    storage once and keeps the second save's device reference (`analytic.offloaded`)."""
    held: int = 0
    """Outputs the model's return value holds (`image_outputs`) until the forward returns."""
    parts: tuple[int, ...] = ()
    """The tensors of `saved`, in the order the forward makes them (for the allocator replay
    of `events.py`; the bytes not listed count as one tensor). Likewise, the tensors of:"""
    fwd_parts: tuple[int, ...] = ()
    """... `fwd_extra`,"""
    bwd_parts: tuple[int, ...] = ()
    """... `bwd_extra`,"""
    bwd_mlp_parts: tuple[int, ...] = ()
    """... `bwd_mlp`."""
    fwd_after_top: int = 0
    """Part of `saved` made after the forward's high point (`fwd_extra`), not alive there: the
    second half of an eager attention layer (`eager_top.forward_top`; timeline.walk)."""
    bwd_top_freed: int = 0
    """Part of `saved` (outside `mlp_saved`) freed before the high point of the backward's
    last stage (`bwd_extra`): eager attention's o_proj input, v and probs cast
    (`eager_top.backward_top`; timeline.walk)."""
    grad_in_saved: int = 0
    """Bytes of `saved` that become this layer's weight grad at its backward (Liger's FLCE
    computes grad_weight in the forward and returns the saved tensor): not a second copy."""
    ckpt_alias: int = 0
    """Bytes of `saved` that are the layer's input itself (RMSNorm's fp32 input when the
    stream is fp32: `hidden_states.to(torch.float32)` returns it): checkpointed, the
    checkpoint holds that tensor (`ckpt_saved`) and the recompute does not make it again."""
    recompute_extra: int = 0
    """Transient on top of `recomputed` at a checkpointed layer's recompute top (a forward
    under autograd, unlike the no_grad first pass `fwd_extra` prices); 0: not counted."""

    @property
    def recomputed(self) -> int:
        """Bytes a checkpointed layer's recompute makes: `saved` less the input it is given
        (none when the input is offloaded: `ckpt_saved` 0, `analytic.offloaded`)."""
        return self.saved - min(self.ckpt_alias, self.ckpt_saved)


class Saved:
    def __init__(self) -> None:
        self.total = 0
        self.sizes: list[int] = []

    def add(self, numel: int, itemsize: int, cond: bool = True, times: int = 1) -> None:
        if cond and times > 0:
            size = t(numel, itemsize)
            self.total += times * size
            self.sizes += [size] * times


def adapters_on(layer: Layer, names: tuple[str, ...]) -> int:
    """How many of the named linears of this layer carry LoRA adapters."""
    return sum(1 for p in layer.lora if "lora_A" in p.name and p.name.split(".lora_A")[0]
               .split(".")[-1] in names)


def lora_matrices(layer: Layer) -> tuple:
    """lora_A / lora_B of the layer (not DoRA's magnitude vectors, which no matmul reads)."""
    return tuple(p for p in layer.lora if "lora_magnitude_vector" not in p.name)


def _linear_of(name: str) -> str:
    """`self_attn.q_proj.lora_A.default.weight` -> `self_attn.q_proj` (`` for lm_head)."""
    return name.rsplit("lora_", 1)[0].rstrip(".")


def dora_linears(layer: Layer, names: tuple[str, ...] | None = None) -> list[tuple[int, int, int]]:
    """(in, out, r) of the layer's DoRA linears (those with a magnitude vector), by name."""
    a = {_linear_of(p.name): p.shape for p in layer.lora if "lora_A." in p.name}
    out = []
    for p in layer.lora:
        lin = _linear_of(p.name)
        if "lora_magnitude_vector" in p.name and (names is None or lin.split(".")[-1] in names):
            r, n_in = a[lin]
            out.append((n_in, p.shape[0], r))
    return out


def dora_saved(sv: Saved, c: Ctx, tokens: int, linears: list[tuple[int, int, int]],
               need_in: bool) -> None:
    """What autograd keeps of each DoRA linear beyond LoRA's (dora.py `forward`):
    `(mag_norm_scale - 1) * base_result` saves base_result (B x out; the base layer's output,
    or with dropout `F.linear(dropout(x), W.to(x.dtype))`, fp32 in a pure run) and, when
    base_result needs a grad, `mag_norm_scale - 1`; `mag_norm_scale * lora_result` saves
    lora_result (B x out, lora_B's output) and mag_norm_scale; `magnitude / weight_norm` saves
    the detached weight_norm (out, fp32). With dropout, F.linear also saves the weight copy it
    multiplies (fp32 `.to` copy; autocast's bf16 cast) when its input needs a grad."""
    dropout = c.lora_dropout > 0
    adapter = 2 if c.amp else FP32  # lora_B's output dtype (as in `lora_outputs`)
    for n_in, n_out, _ in linears:
        sv.add(tokens * n_out, adapter if dropout else c.e)   # base_result
        sv.add(tokens * n_out, adapter)                         # lora_result
        sv.add(n_out, FP32, times=2)                            # weight_norm, mag_norm_scale
        sv.add(n_out, FP32, cond=need_in)                       # mag_norm_scale - 1
        if dropout and need_in:
            sv.add(n_out * n_in, 2 if c.amp else FP32, cond=c.amp or c.e != FP32)


def dora_forward(c: Ctx, linears: list[tuple[int, int, int]]) -> tuple[int, ...]:
    """Tensors alive at the top of one DoRA linear's forward, the largest linear's (dora.py):
    `get_lora_weight` runs lora_B(lora_A(eye(in))) (fp32 eye; under autocast its bf16 cast
    and a bf16 product cast back `.to(x.dtype)` = fp32), `weight.to(x.dtype)` an fp32 copy of
    a bf16/fp16 weight, and `get_weight_norm` `weight + scaling * lora_weight`: two more
    full-weight fp32 tensors. All die when the forward returns (the norm is detached, the
    lora_weight graph unreferenced)."""
    best: tuple[int, ...] = ()
    for n_in, n_out, r in linears:
        parts = [t(n_in * n_in, FP32), t(n_in * r, 2 if c.amp else FP32)]
        if c.amp:
            parts += [t(n_in * n_in, 2), t(n_in * n_out, 2)]
        parts.append(t(n_in * n_out, FP32))                     # lora_weight in x's dtype
        if not c.amp and c.e != FP32:
            parts.append(t(n_in * n_out, FP32))                 # weight.to(fp32)
        parts += [t(n_in * n_out, FP32)] * 2                    # scaling * lora_w, the sum
        if sum(parts) > sum(best):
            best = tuple(parts)
    return best


def linear_inputs(sv: Saved, c: Ctx, numel: int, in_bytes: int, n_base: int, base_w: bool,
                   adapters: int, shared: bool, in_grad: bool = True, bnb: bool = False) -> None:
    """Inputs saved by `n_base` linears reading one tensor of `numel` elements.

    `shared`: the tensor itself is already saved by another op (no new memory when saved again).
    Under autocast each linear casts an fp32 input separately (one saved copy per linear).
    `in_grad`: the tensor needs a grad (decides what a frozen lora_A's branch saves).
    `bnb`: the adapters wrap bitsandbytes layers (peft/tuners/lora/bnb.py Linear4bit.forward:
    `_cast_input_dtype` only when `not torch.is_autocast_enabled()`), so under autocast a
    half-precision input reaches lora_A as it is, no fp32 round trip.
    """
    dropout = c.lora_dropout > 0
    # LoRA dropout (nn.Dropout before lora_A) saves a bool mask per adapter and hands lora_A a
    # new tensor; without it PEFT uses nn.Identity
    sv.add(numel, 1, times=adapters if dropout and (in_grad or not c.frozen_a) else 0)
    if c.frozen_a:
        # frozen lora_A (derivatives.yaml mm: `self` is saved only for mat2's grad): its input
        # is not saved; the base linear's input below is
        adapters = 0
    if c.autocast:
        cast = in_bytes != 2
        if base_w:
            sv.add(numel, 2, times=n_base if cast else 1, cond=cast or not shared)
        if bnb and not cast:  # lora_A saves the half-precision input itself
            sv.add(numel, 2, cond=adapters > 0 and not shared and not base_w)
        else:
            sv.add(numel, 2, times=adapters)  # PEFT casts to fp32, autocast back: a copy each
    else:
        sv.add(numel, in_bytes, cond=base_w and not shared)
        if adapters:
            if in_bytes == c.adapter and not dropout:
                sv.add(numel, c.adapter, cond=not base_w and not shared)
            else:  # `_cast_input_dtype` copy in the adapters' dtype (or dropout output) each
                sv.add(numel, c.adapter, times=adapters)


def lora_outputs(sv: Saved, c: Ctx, tokens: int, adapters: int) -> None:
    sv.add(tokens * c.lora_r, 2 if c.autocast else c.adapter, times=adapters)


def linear_weights(layer: Layer) -> int:
    return sum(p.numel for p in layer.params if len(p.shape) == 2 or p.name.endswith("bias"))


def amp_copies(layer: Layer, c: Ctx, active: bool, need_w: bool) -> tuple[int, int]:
    """(saved, cached) bytes of bf16 weight copies under autocast. A quantised weight has
    none: bitsandbytes dequantises it inside its autograd.Function (`quant_transients`)."""
    if not c.autocast or not active:
        return 0, 0
    quantized = sum(p.numel for p in layer.params if p.name in layer.quantized)
    # half weights under autocast are used as they are: only the fp32 adapters are cast
    base = t(linear_weights(layer) - quantized, 2) if layer.params and c.amp else 0
    lora = sum(t(p.numel, 2) for p in lora_matrices(layer))
    # autocast caches casts of leaf tensors that require grad only (`can_try_cache`): a frozen
    # lora_A's copy is saved by its matmul like a frozen base weight's, not cached
    frozen = sum(t(p.numel, 2) for p in lora_matrices(layer) if p.frozen)
    return base + lora, (base if need_w else 0) + lora - frozen


def attention_core(sv: Saved, c: Ctx, b: int, s: int, heads: int, qd: int, kvd: int,
                   qkv: int = 0, softcap: bool = False, rep_kv: bool = False) -> int:
    """Saved q/k/v/out(+lse or probs) of one attention; returns the eager probs size (b·a·s²).

    `qkv` > 0: v is a slice of a fused qkv_proj output of `qkv` elements (Phi-3); RoPE makes new
    q and k, but v is saved as that view, which keeps the whole fused output alive (unless
    eager's repeat_kv copies it first). `softcap`: eager's attention-logit softcapping;
    `rep_kv`: SDPA given a mask (k, v repeated)."""
    B = b * s
    e = c.e
    probs = b * heads * s * s
    v_el = qkv or B * kvd
    if c.attn == "eager":
        rep = qd  # repeat_kv materialises k and v at all heads when kv_heads < heads
        k_el = rep if kvd < qd else kvd
        sv.add(B * qd, e)       # q (cast copy under autocast)
        sv.add(B * k_el, e)     # k (repeated)
        # Gemma 2's attention-logit softcap (modeling_gemma2.eager_attention_forward:
        # `tanh(w / cap) * cap`): tanh saves its output for its backward
        sv.add(probs, e, cond=softcap)
        sv.add(probs, FP32)     # softmax(dtype=float32) output
        sv.add(probs, e, cond=e != FP32)  # .to(q.dtype) / autocast cast, saved by probs @ v
        sv.add(B * k_el if kvd < qd else v_el, e)  # v (repeated: a copy)
        return probs
    # rep_kv: with an explicit mask transformers' sdpa_attention_forward does not hand GQA to
    # SDPA (`use_gqa_in_sdpa` needs attention_mask None): repeat_kv copies k and v to all heads
    sv.add(B * qd, e)
    sv.add(B * qd if rep_kv else B * kvd, e)
    sv.add(B * qd if rep_kv else v_el, e)
    sv.add(B * qd, e)           # output
    rows = s  # flash / cuDNN (half precision): one fp32 logsumexp per query row
    if e == FP32 and c.attn != "flash_attention_2":  # fp32 runs the mem-efficient kernel
        rows = -(-s // LSE_ALIGN_EFFICIENT) * LSE_ALIGN_EFFICIENT
    sv.add(b * heads * rows, FP32)  # logsumexp
    return 0


def quant_transients(layer: Layer, c: Ctx, tokens: int, in_bytes: dict[str, int],
                     lora: bool = False, staged: bool = False
                     ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Tensors alive at the top of the largest quantised linear's (forward, MLP backward,
    attention backward), from bitsandbytes `Linear4bit.forward` / `MatMul4Bit`
    (`hybridmem.techniques.quantize`). `in_bytes`: linear name -> itemsize of its input (= of its
    output). The order (trace tier, tiny-llama nf4 LoRA b2 s64, per-op events of one linear):
    forward `x.to(compute)` (when the input differs), the dequantised weight
    (`Quant.dequant`), the matmul output in the compute dtype, its cast back to the input
    dtype, then x's cast and the matmul output are freed before PEFT's LoRA wrapper clones
    the result (peft/tuners/lora/bnb.py "defensively clone"); backward the grad cast to the
    compute dtype, the weight dequantised again, grad_A, then the grad cast and the weight are
    freed before grad_A's cast back. MLP backward of an adapted linear: PEFT adds the adapter
    to the base output, so autograd runs the adapter branch first (made later, higher
    sequence number): lora_A's input grad (`tokens x in`, the input's dtype) is alive through
    the base backward, whose input grad is then summed with it into a new tensor (autograd's
    input buffer, out of place), when `staged` (the caller subtracts what the adapter branch
    freed: `common.decoder_acts.quant_mlp_backward`)."""
    q = c.quant
    if q is None or not layer.quantized:
        return (), (), ()
    best = {"fwd": (), "mlp": (), "attn": ()}

    def keep(key: str, parts: list[int]) -> None:
        if sum(parts) > sum(best[key]):
            best[key] = tuple(parts)

    for p in layer.params:
        if p.name not in layer.quantized:
            continue
        n_out, n_in = p.shape
        linear = p.name[: -len(".weight")].split(".")[-1]
        ib = in_bytes.get(linear, c.stream)
        cb = q.compute_bytes if q.four_bit else ib
        if c.amp:
            cb = c.e  # autocast runs F.linear / matmul in its dtype whatever compute_dtype says
        deq = [t(a.numel, a.itemsize) for a in q.dequant(n_out, n_in, cb)]
        top = max((deq[i:i + 2] for i in range(len(deq))), key=sum)
        # Linear4bit.forward keeps x.to(compute) in a local until it returns out.to(inp_dtype)
        keep("fwd", _matmul_tops(deq, top, tokens * n_in, tokens * n_out, cb, ib, True,
                                 [t(tokens * n_out, ib)] if lora else []))
        mlp = p.name.startswith("mlp.")
        adapter = staged and mlp and q.four_bit and adapters_on(layer, (linear,)) > 0
        gx = t(tokens * n_in, ib)  # the adapter branch's input grad, then the sum
        # MatMul4Bit.backward's grad cast dies with it, before x.to()'s ToCopyBackward
        bwd = _matmul_tops(deq, top, tokens * n_out, tokens * n_in, cb, ib, False,
                           [gx] if adapter else [])
        keep("mlp" if mlp else "attn", [gx] + bwd if adapter else bwd)
    return best["fwd"], best["mlp"], best["attn"]


def _matmul_tops(deq: list[int], top: list[int], n_a: int, n_out: int, cb: int, ib: int,
                 held: bool, after: list[int]) -> list[int]:
    """The largest set of tensors alive together in one `MatMul4Bit` pass over an input of
    `n_a` elements giving `n_out` (`quant_transients` gives the order): the input cast with
    the dequantisation's top, or with the weight and the matmul output, the output with its
    cast back (and the input cast when `held`); then the cast back with `after` (PEFT's clone
    in the forward, the input-grad sum in an adapted linear's backward)."""
    a_cast = [t(n_a, cb)] if cb != ib else []
    out = [t(n_out, cb)]
    back = [t(n_out, ib)] if cb != ib else []
    return max([a_cast + top, a_cast + [deq[-1]] + out, (a_cast if held else []) + out + back,
                (back or out) + after], key=sum)


def image_merge(b: int, s: int) -> int:
    """`masked_scatter` of image features saves the (b, s, 1) bool mask."""
    return t(b * s, 1)


def keeps_nothing(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """A layer kind that saves nothing for backward (LLaVA-NeXT's image_newline: expand +
    cat; SigLIP's pooling head: off the grad path)."""
    return Acts()
