"""The Idefics3 / SmolVLM connector's activations (`Idefics3Connector`: pixel shuffle, then
one bias-free Linear; transformers 5.24 `modeling_idefics3.py`), op by op with PyTorch's
`tools/autograd/derivatives.yaml`. The tower is SigLIP-like: CLIP's encoder layer
(`families/llava`)."""

from __future__ import annotations

from hybridmem.allocator.alloc import t
from hybridmem.families.common.activations import Acts, Ctx, Saved
from hybridmem.models.graph import Layer


def pixel_shuffle_projector(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """Idefics3 `Idefics3Connector` (modeling_idefics3.py): `pixel_shuffle` = view, permute,
    reshape (a copy), permute, reshape (a copy) of the (n, T, E) tower output in the stream
    dtype; `modality_projection.proj` (no bias) saves that copy (autocast: its bf16 cast) for
    its weight grad and the weight's bf16 cast for the input grad; the output is held by
    `image_outputs.pooler_output` (split views) until the forward returns."""
    d = layer.dims
    n, T, h, s2, out = d["n"], d["t"], d["h"], d["s2"], d["out"]
    if not layer.runs or n == 0:
        return Acts()
    sb, e = c.stream, c.e
    K = T // s2
    held = t(n * K * out, e)
    if not (need_in or need_w):
        return Acts(held=held)
    sv = Saved()
    if c.amp:
        sv.add(n * T * h, 2, need_w)                # bf16 cast of the shuffled input
        sv.add(h * s2 * out, 2, need_in)            # bf16 cast of the weight
    else:
        sv.add(n * T * h, sb, need_w)               # the second reshape's copy
    cache = t(h * s2 * out, 2) if c.amp and need_w else 0
    fwd = (t(n * T * h, sb), t(n * T * h, sb))
    return Acts(saved=sv.total, parts=tuple(sv.sizes), cache=cache, held=held,
                fwd_extra=sum(fwd), fwd_parts=fwd, bwd_extra=2 * t(n * T * h, sb))
