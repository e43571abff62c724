"""Activation formulas of Qwen3-VL's own parts: the resampled learned position embedding, the
(DeepStack) patch mergers, and DeepStack's addition into the first LM layers. The patch embed,
the 2-D rotary tables and the vision blocks are Qwen2-VL's (`acts.py`).

Op by op from transformers 5.24 `modeling_qwen3_vl.py` and PyTorch's
`tools/autograd/derivatives.yaml` (as `hybridmem.families.common.activations` says):

- `pos_embed(idx) * weights[:, :, None]` then `.sum(1)`: the embedding output (patches, 4, E)
  is in the parameter dtype (embeddings are not autocast), the product in fp32 (the weights
  are fp32); when the table trains, `embedding` saves the (patches, 4) int64 indices and `mul`
  the fp32 weights; the sum is cast to the stream dtype and added to the patch embedding;
- a merger's LayerNorm runs in fp32 under CUDA autocast (an fp32 cast of its input, mean and
  rstd, per row of hidden for `merger`, of hidden·m² for a DeepStack merger); linear_fc1 -
  GELU (saves its input) - linear_fc2; the output stays referenced by
  `image_outputs` until the forward returns, and `Qwen3VLModel.forward` holds a
  `torch.cat` copy of every DeepStack level for the whole LM forward;
- `_deepstack_process`: `hidden_states.clone()`, a bool-mask gather, an add and an
  `index_put_` of the image rows: nothing new is saved (both index ops save the mask).
"""

from __future__ import annotations

from hybridmem.families.common.activations import FP32, INT64, Acts, Ctx, Saved, linear_inputs
from hybridmem.allocator.alloc import t
from hybridmem.families.qwen_vl.acts import norm_out_bytes
from hybridmem.models.graph import Layer

LINEARS = ("linear_fc1.", "linear_fc2.")  # a merger's linears (cast under autocast)


def pos_embed(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    d = layer.dims
    n, h, taps = d["n"], d["h"], d["taps"]
    if not layer.runs or n == 0:
        return Acts()
    p = c.param
    saved = t(n * taps, INT64) + t(n * taps, FP32) if need_w else 0  # indices, weights
    fwd_parts = (t(n * taps * h, p), t(n * taps * h, FP32))          # embedding out, product
    bwd_parts = (t(n * taps * h, FP32), t(n * taps * h, p)) if need_w else ()
    return Acts(saved=saved, parts=(t(n * taps, INT64), t(n * taps, FP32)) if need_w else (),
                fwd_extra=sum(fwd_parts), fwd_parts=fwd_parts,
                bwd_extra=sum(bwd_parts), bwd_parts=bwd_parts)


def merger(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """A `Qwen3VLVisionPatchMerger` over the (n, hidden) output of its block."""
    d = layer.dims
    n, h, out, post = d["n"], d["h"], d["out"], d["postshuffle"]
    if not layer.runs or n == 0:
        return Acts()
    e = c.e
    tokens = d["tokens"] * out
    # DeepStack: the merger output and `Qwen3VLModel.forward`'s cat copy; the final merger: its
    # output (`image_outputs`), the cat copy and its fp32 cast are transients of the merge
    held = t(tokens, e) * (2 if post else 1)
    fwd_parts = (t(tokens, e),) if post else (t(tokens, e),) + ((t(tokens, FP32),) if c.amp else ())
    if not (need_in or need_w):
        return Acts(held=held, fwd_extra=sum(fwd_parts), fwd_parts=fwd_parts)
    sv = Saved()
    rows = n // d["m2"] if post else n
    # LayerNorm input: a new fp32 cast under autocast; else the block output itself, which the
    # next block (or, for the last block, the final merger) saves: counted there
    sv.add(n * h, FP32 if c.amp else e, cond=c.amp or not post)
    sv.add(rows, FP32, times=2)                      # mean, rstd
    linear_inputs(sv, c, n * h, norm_out_bytes(c), 1, need_w, 0, shared=False)  # linear_fc1 input
    sv.add(n * h, e)                                 # GELU input
    sv.add(n * h, e, need_w)                         # linear_fc2 input
    copies = (sum(t(p.numel, 2) for p in layer.params if p.name.startswith(LINEARS))
              if c.amp else 0)
    cache = copies if need_w else 0
    return Acts(saved=sv.total + copies, parts=(copies, *sv.sizes), cache=cache, held=held,
                fwd_extra=sum(fwd_parts), fwd_parts=fwd_parts, bwd_extra=2 * t(n * h, e),
                bwd_parts=(t(n * h, e), t(n * h, e)))


def deepstack_add(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """`_deepstack_process` after an LM layer: the clone beside the layer output, the gathered
    rows and their sum (plus the features' cast to the fp32 stream under autocast)."""
    d = layer.dims
    bsh, rows = d["b"] * d["s"] * d["h"], d["rows"] * d["h"]
    if rows == 0:
        return Acts()
    s = c.stream
    fwd_parts = (t(bsh, s), t(rows, s), t(rows, s)) + ((t(rows, s),) if c.amp else ())
    # IndexPutBackward: a masked copy of the grad and the gathered rows; IndexBackward: zeros
    # of the full shape with the rows put back
    bwd_parts = (t(bsh, s), t(rows, s), t(bsh, s)) if need_in else ()
    return Acts(fwd_extra=sum(fwd_parts), fwd_parts=fwd_parts, bwd_extra=sum(bwd_parts),
                bwd_parts=bwd_parts)
