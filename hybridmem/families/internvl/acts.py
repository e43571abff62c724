"""Activation formulas of InternVL's vision side (transformers 5.24 `modeling_internvl.py`),
op by op with PyTorch's `tools/autograd/derivatives.yaml`.

- `InternVLVisionLayer` (LayerNorm, no q/k norm: InternViT-300M) is CLIP's encoder layer (`llava.acts.encoder_layer`: LayerNorm,
  q/k/v linears, SDPA, projection_layer, LayerNorm, fc1 - GELU - fc2) plus layer scale:
  `lambda_1 * attention_output` and `lambda_2 * layer_output` save the branch outputs (the
  matmul dtype) for the lambdas' grads, and make a stream-dtype product before each residual
  add (fp32 lambda x bf16 branch promotes under autocast); InternViT-6B's RMSNorms and q/k
  norms change what the norms save (`_norm_options`);
- the final `layernorm` is nn.Identity under `use_mean_pooling`: `last_hidden_state` (the last
  layer's output) is held by `image_outputs` until the forward returns;
- the projector (`InternVLModel.get_image_features` + `InternVLMultiModalProjector`): the CLS
  slice and the reshapes are views, `pixel_shuffle`'s two `permute(...).contiguous()` are
  copies (the second is the LayerNorm's saved input); LayerNorm saves it, mean and rstd;
  linear_1 saves the LayerNorm output (autocast: its bf16 cast), GELU its input, linear_2 the
  GELU output; the output is held by `image_outputs.pooler_output`.
"""

from __future__ import annotations

from dataclasses import replace

from hybridmem.families.common.activations import FP32, Acts, Ctx, Saved
from hybridmem.allocator.alloc import t
from hybridmem.families.common.clip_siglip_acts import encoder_layer as clip_layer, layernorm
from hybridmem.models.graph import Layer


def encoder_layer(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """`InternVLVisionLayer`: CLIP's encoder layer with InternViT's layer scale and norm
    options (`with_layer_scale`)."""
    return with_layer_scale(clip_layer(layer, c, need_in, need_w), layer, c, need_w)


def with_layer_scale(acts: Acts, layer: Layer, c: Ctx, need_w: bool) -> Acts:
    """`llava.acts.encoder_layer`'s result plus what InternViT adds: each lambda mul saves the
    branch output (N x h, matmul dtype) when the lambda trains; forward, the stream-dtype
    product before the residual add; backward, the product's grad w.r.t. the branch and the
    lambda's per-element product (reduced to h). Then the norm options (`_norm_options`)."""
    if not acts.saved and not acts.ckpt_saved:
        return acts
    d = layer.dims
    N, h = d["n"] * d["t"], d["h"]
    branch = t(N * h, c.e) if need_w else 0
    scaled = t(N * h, c.stream)
    extra = (t(N * h, c.stream), t(N * h, c.e))
    norms, norms_mlp = _norm_options(d, c, N, h, need_w)
    return replace(
        acts, saved=acts.saved + 2 * branch + sum(norms),
        parts=acts.parts + ((branch, branch) if branch else ()) + norms,
        mlp_saved=acts.mlp_saved + branch + sum(norms_mlp),
        fwd_extra=acts.fwd_extra + scaled, fwd_parts=acts.fwd_parts + (scaled,),
        bwd_extra=acts.bwd_extra + sum(extra), bwd_parts=acts.bwd_parts + extra,
        bwd_mlp=acts.bwd_mlp + sum(extra), bwd_mlp_parts=acts.bwd_mlp_parts + extra)


def _rms_saved(N: int, h: int, in_bytes: int, need_w: bool) -> tuple[int, ...]:
    """InternVLVisionRMSNorm.forward on an (N, h) input of `in_bytes`: `.to(float32)` (the
    input itself when fp32) saved by pow and mul, rsqrt (N, fp32), and `.to(input_dtype)` of
    the product, saved by `weight *` for the weight's grad."""
    return (t(N * h, FP32), t(N, FP32)) + ((t(N * h, in_bytes),) if need_w else ())


def _norm_options(d: dict, c: Ctx, N: int, h: int, need_w: bool
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Saved bytes the norm options add to the CLIP layer's count (all of them, the MLP
    half's): `use_qk_norm` RMSNorms on the q/k projections' outputs (matmul dtype; the
    normed q/k that SDPA saves replace the projections' outputs one for one);
    `norm_type` rms_norm instead of the LayerNorms (stream dtype), whose input, mean and
    rstd `encoder_layer` counted."""
    if not need_w:
        return (), ()
    qk = _rms_saved(N, h, c.e, need_w) * 2 if d.get("qk_norm") else ()
    if not d.get("rms"):
        return qk, ()
    ln = t(N * h, c.stream) + 2 * t(N, FP32)
    rms = _rms_saved(N, h, c.stream, need_w)
    # the LayerNorm's saved bytes were counted: the difference, as one tensor per norm
    one = sum(rms) - ln
    return qk + (one, one), (one,)


def final_norm(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """nn.Identity (use_mean_pooling): the held last_hidden_state; else a LayerNorm on the
    feature path (`llava.acts.layernorm`, `feeds`)."""
    d = layer.dims
    if not d.get("identity"):
        return layernorm(layer, c, need_in, need_w)
    if not layer.runs or d["n"] == 0:
        return Acts()
    return Acts(held=t(d["n"] * d["t"] * d["h"], c.stream))


def projector(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    d = layer.dims
    n, P, h, s2, out = d["n"], d["t"], d["h"], d["s2"], d["out"]
    if not layer.runs or n == 0:
        return Acts()
    sb, e = c.stream, c.e
    K, w = n * P // s2, h * s2           # tokens after the shuffle, their width
    held = t(K * out, e)                  # pooler_output
    shuffled = (t(n * P * h, sb), t(n * P * h, sb))  # the two contiguous copies
    if not (need_in or need_w):
        return Acts(held=held, fwd_extra=sum(shuffled), fwd_parts=shuffled)
    sv = Saved()
    sv.add(K * w, sb)                     # LayerNorm input (the second copy)
    sv.add(K, FP32, times=2)              # mean, rstd
    if c.amp:
        sv.add(K * w, 2, need_w)          # bf16 cast of the LayerNorm output (linear_1)
    else:
        sv.add(K * w, sb, need_w)         # the LayerNorm output
    sv.add(K * out, e)                    # GELU input
    sv.add(K * out, e, need_w)            # linear_2 input
    copies = cache = 0
    if c.amp:
        w1, w2 = t(out * w + out, 2), t(out * out + out, 2)
        # linear_1's input needs a grad whenever the LayerNorm weights train (need_w)
        copies = w2 + (w1 if need_w or need_in else 0)
        cache = (w1 + w2) if need_w else 0
    fwd = (shuffled[1], t(K * w, sb), t(K * out, c.stream))
    return Acts(saved=sv.total + copies, parts=(copies, *sv.sizes), cache=cache, held=held,
                fwd_extra=sum(fwd), fwd_parts=fwd,
                bwd_extra=2 * t(K * out, e) + 2 * t(K * w, sb),
                bwd_parts=(t(K * out, e), t(K * out, e), t(K * w, sb), t(K * w, sb)))
