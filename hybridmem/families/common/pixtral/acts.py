"""Activation formulas of Mistral-3's vision side: Pixtral's patch conv, ln_pre, 2-D rotary
tables and block mask, Pixtral blocks, `Mistral3MultiModalProjector`.

Op by op from transformers 5.24 `modeling_pixtral.py` / `modeling_mistral3.py` and
`tools/autograd/derivatives.yaml` (the rules `hybridmem.families.common.activations` lists):

- the patch conv runs in the compute dtype; `ln_pre` (PixtralRMSNorm = LlamaRMSNorm's code)
  multiplies its fp32 weight into the normalised bf16 input under autocast, so the tower's
  residual stream is fp32 there (the param dtype in pure runs): the stream of the LM (`c.stream`);
- a Pixtral block is a Llama decoder layer on one sequence of all N patches of the step
  (RMSNorm, q/k/v/o without bias, RoPE with cos/sin in the stream dtype, SDPA, SwiGLU): priced by
  `common.decoder_acts.decoder_layer` (batch 1, sequence N, as many kv heads as heads), plus
  the block mask: `generate_block_attention_mask` builds one dense (1, 1, N, N) additive mask in the
  stream dtype that every SDPA saves; under autocast SDPA casts it to bf16 in every block
  (autocast caches only leaf casts), a copy each block's SDPA saves;
- the projector: Mistral3RMSNorm, `Mistral3PatchMerger` (`unfold` = a new (E·m², L) tensor per
  image and `torch.cat` of them, whose backwards need sizes only), `merging_layer`, linear_1,
  GELU, linear_2; `pooler_output` (split views of the output) is held until the forward returns.
"""

from __future__ import annotations

from dataclasses import replace

from hybridmem.families.common import decoder_acts as TA
from hybridmem.families.common.activations import FP32, INT64, Acts, Ctx, Saved, amp_copies, linear_inputs
from hybridmem.allocator.alloc import t
from hybridmem.models.graph import Layer


def _rms(sv: Saved, c: Ctx, n: int, h: int, in_bytes: int, need_in: bool, need_w: bool) -> None:
    """LlamaRMSNorm's code (Pixtral/Mistral3RMSNorm): `pow` and `mul` save the fp32 input (an
    upcast copy unless it is fp32) and rsqrt when the input needs a grad; `weight * h.to(in)`
    saves h (the input's dtype) when the weight trains."""
    sv.add(n * h, FP32, need_in)
    sv.add(n, FP32, need_in)
    sv.add(n * h, in_bytes, need_w)


def patch_conv(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """Conv2d over the (images, C, H, W) pixels: saves its input for the weight grad
    (autocast's bf16 copy; in pure runs the batch tensor itself). Its output (images, E, h, w)
    stays referenced by `patch_embeds_list` through the tower's forward. Under checkpointing
    `enable_input_require_grads` hooks the conv (PixtralVisionModel.get_input_embeddings): a
    frozen conv's output is a grad-requiring leaf kept through backward, with a .grad
    (`llava.acts.vision_embeddings` has the same rule)."""
    d = layer.dims
    n, h = d["n"], d["h"]
    if not layer.runs or n == 0:
        return Acts()
    pixels = d["images"] * d["channels"] * d["h_px"] * d["w_px"]
    saved = t(pixels, 2) if c.amp and need_w else 0
    copies = t(layer.num_params, 2) if c.amp and need_w else 0
    leaf = t(n * h, c.e) if c.ckpt and not need_w else 0
    return Acts(saved=saved + copies + leaf, cache=copies, fwd_extra=2 * t(n * h, c.e),
                bwd_extra=(t(n * h, c.e) if need_w else 0) + leaf)


def ln_pre(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """RMSNorm of the concatenated patches (compute dtype in, stream dtype out)."""
    d = layer.dims
    n, h = d["n"], d["h"]
    if not layer.runs or n == 0 or not (need_in or need_w):
        return Acts()
    sv = Saved()
    _rms(sv, c, n, h, c.e, need_in, need_w)
    # forward: the fp32 upcast (a copy unless fp32) and the fp32 normalised tensor
    fwd = (t(n * h, FP32),) * (2 if c.e != FP32 else 1)
    return Acts(saved=sv.total, parts=tuple(sv.sizes), fwd_extra=sum(fwd), fwd_parts=fwd,
                bwd_extra=2 * t(n * h, c.stream))


def rotary(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """cos, sin (N, head_dim) in the stream dtype and the (N, N) block mask, made once per
    forward and saved by every block's RoPE / SDPA."""
    d = layer.dims
    n = d["n"]
    if not layer.runs or n == 0 or not need_in:
        return Acts()
    tables = 2 * t(n * d["head_dim"], c.stream)
    mask = t(n * n, c.stream)
    # forward: (N, 2) int64 positions, the (N, 2, head_dim/2) fp32 angles and their cos / sin
    fwd = (t(2 * n, INT64), t(n * d["head_dim"], FP32), t(n * d["head_dim"], FP32))
    return Acts(saved=tables + mask, parts=(tables // 2, tables // 2, mask),
                fwd_extra=sum(fwd), fwd_parts=fwd)


def as_decoder(layer: Layer) -> Layer:
    """A Pixtral block as the Llama decoder layer it prices as: batch 1, sequence N, as many kv
    heads as heads (also `analytic.sac`'s cached set: the same seven mms in the same order)."""
    d = layer.dims
    return replace(layer, kind="decoder_layer",
                   dims=dict(b=1, s=d["n"], h=d["h"], heads=d["heads"], kv_heads=d["heads"],
                             head_dim=d["head_dim"], ffn=d["ffn"]))


def block(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """A Pixtral block as a Llama decoder layer over (1, N), plus the autocast mask copy."""
    n = layer.dims["n"]
    if not layer.runs or n == 0:
        return Acts()
    dec = as_decoder(layer)
    # Liger patches the LM's modules only (`hybridmem.techniques.liger`), never the Pixtral tower
    acts = TA.decoder_layer(dec, replace(c, liger=False), need_in, need_w)
    if c.amp and acts.saved:
        mask = t(n * n, c.e)  # SDPA's autocast cast of the fp32 mask, saved per block
        acts = replace(acts, saved=acts.saved + mask, parts=acts.parts + (mask,))
    return acts


def projector(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """norm - patch merger (unfold, cat, merging_layer) - linear_1 - GELU - linear_2."""
    d = layer.dims
    n, h, m2, out, tok = d["n"], d["h"], d["m2"], d["out"], d["tokens"]
    if not layer.runs or n == 0:
        return Acts()
    e, sb = c.e, c.stream
    held = t(tok * out, e)  # `image_outputs.pooler_output` (split views of the output)
    # Mistral3Model.forward: `torch.cat(pooler_output)` and its `.to(inputs_embeds.dtype)`
    # (fp32 under autocast), alive until `masked_scatter` ran
    merge = (t(tok * out, e),) + ((t(tok * out, FP32),) if c.amp else ())
    if not (need_in or need_w):
        return Acts(held=held, fwd_extra=sum(merge), fwd_parts=merge)
    sv = Saved()
    _rms(sv, c, n, h, sb, need_in, need_w)
    linear_inputs(sv, c, tok * h * m2, sb, 1, need_w, 0, shared=False)  # merging_layer input
    linear_inputs(sv, c, tok * h, e, 1, need_w, 0, shared=False)        # linear_1 input
    sv.add(tok * out, e)                                                # GELU input
    linear_inputs(sv, c, tok * out, e, 1, need_w, 0, shared=False)      # linear_2 input
    copies, cache = amp_copies(layer, c, True, need_w)
    return Acts(saved=sv.total + copies, parts=(copies, *sv.sizes), cache=cache,
                fwd_extra=sum(merge), fwd_parts=merge, held=held,
                bwd_extra=2 * t(n * h, sb))


def pixel_bytes(layer: Layer, graph, pix: int) -> int:
    """`LayerKind.pixel_bytes`: the processor's (images, C, H, W) `pixel_values` in the model
    dtype and the (images, 2) int64 `image_sizes` (`Family.pixel_inputs`)."""
    if not graph.image_tokens:
        return 0
    d = layer.dims
    return t(d["images"] * d["channels"] * d["h_px"] * d["w_px"], pix) + t(2 * d["images"], INT64)

