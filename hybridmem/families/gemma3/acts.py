"""Activation formula of `Gemma3MultiModalProjector` (transformers 5.24 `modeling_gemma3.py`),
op by op with PyTorch's `tools/autograd/derivatives.yaml`.

x = the tower's `last_hidden_state` (n, T, E) in the stream dtype (fp32 under autocast: the
SigLIP residual stream and CUDA autocast's fp32 LayerNorm):
- `x.transpose(1, 2).reshape(n, E, p, p).contiguous()`: a copy, saved by `avg_pool2d`
  (its backward takes `self`) when the tower trains;
- `avg_pool2d` -> (n, E, k, k), `flatten(2).transpose(1, 2)`: a view (n, K, E), K = k²;
- Gemma3RMSNorm: `x.float()` (a copy unless fp32), saved by `pow` and by `x * rsqrt(...)`;
  the fp32 rsqrt (n, K), saved by its own backward and the mul; the normed fp32 tensor, saved
  by `* (1 + weight)` for the weight grad; `.type_as(x)` (a copy unless the stream is fp32);
- `torch.matmul(normed, W)` (E x LM hidden): the elementwise outputs keep the transposed
  layout, so folding to 2-D copies the input; mm saves that copy (or autocast's bf16 cast)
  for W's grad, and W (its bf16 cast under autocast) for the input's grad;
- `.type_as(x)`: the output cast back to the stream dtype; `image_outputs.pooler_output`
  holds it until the forward returns.
"""

from __future__ import annotations

from hybridmem.families.common.activations import FP32, Acts, Ctx, Saved
from hybridmem.allocator.alloc import t
from hybridmem.models.graph import Layer


def mm_projector(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    d = layer.dims
    n, T, K, h, out = d["n"], d["t"], d["k"], d["h"], d["out"]
    if not layer.runs or n == 0:
        return Acts()
    sb, e = c.stream, c.e
    held = t(n * K * out, sb)
    if not (need_in or need_w):
        return Acts(held=held)
    sv = Saved()
    sv.add(n * T * h, sb, need_in)               # contiguous copy, avg_pool2d's input
    sv.add(n * K * h, FP32, need_in)             # x.float() (pow / mul input)
    sv.add(n * K, FP32, need_in)                 # rsqrt
    sv.add(n * K * h, FP32, need_w)              # normed, for the weight's grad
    sv.add(h, FP32, need_in)                     # 1 + weight
    if c.amp:
        sv.add(n * K * h, 2, need_w)             # autocast's bf16 cast of the matmul input
        sv.add(h * out, 2, need_in)              # bf16 cast of W
    else:
        sv.add(n * K * h, e, need_w)             # the folded (contiguous) matmul input
    cache = t(h * out, 2) if c.amp and need_w else 0
    fwd = (t(n * K * h, FP32), t(n * K * out, e))
    return Acts(saved=sv.total, parts=tuple(sv.sizes), cache=cache, held=held,
                fwd_extra=sum(fwd), fwd_parts=fwd,
                bwd_extra=t(n * K * h, FP32) + t(n * T * h, sb))
