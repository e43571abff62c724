"""Activation formulas of the Qwen2-VL / Qwen2.5-VL vision side: Conv3d patch embedding, 2-D
rotary tables, vision blocks over the packed patch sequence, the PatchMerger.

Op by op from transformers 5.24 `modeling_qwen2_vl.py` / `modeling_qwen2_5_vl.py` and
PyTorch's `tools/autograd/derivatives.yaml` (as `hybridmem.families.common.activations` says):

- the tower's residual stream is the patch conv's output dtype: the compute dtype (bf16 under
  autocast: conv and linears run in bf16 and bf16 + bf16 stays bf16), unlike CLIP's fp32 stream;
- LayerNorm (Qwen2-VL) runs in fp32 under CUDA autocast (`AT_FORALL_FP32`): it saves an fp32
  cast of its input, mean and rstd; Qwen2RMSNorm (2.5) saves its fp32 input (a copy unless the
  input is fp32), rsqrt, and the normalised input for the weight grad;
- `attn.qkv` is one linear; q/k go through `apply_rotary_pos_emb_vision` (fp32 math, cast
  back): SDPA saves the rotated q, k (new tensors) and v, a view that keeps the whole qkv
  output alive; per attention segment (an image, or a Qwen2.5-VL window) SDPA saves its
  output and fp32 logsumexp; the `torch.cat` of the segment outputs is `attn.proj`'s input;
- MLP: quick_gelu (Qwen2-VL default `hidden_act`) saves its input and the sigmoid output;
  SwiGLU (2.5) the gate output, SiLU output and up output, as the Llama MLP.
"""

from __future__ import annotations

from hybridmem.families.common.activations import (
    FP32, INT64, LSE_ALIGN_EFFICIENT, TWO_TENSOR_ACTS, Acts, Ctx, Saved, linear_inputs,
)
from hybridmem.allocator.alloc import t
from hybridmem.models.graph import Layer

LINEAR_PARTS = ("attn.", "mlp.")  # the block's linears (their weights and biases cast)


def _amp_weights(layer: Layer, c: Ctx, need_w: bool) -> tuple[int, int]:
    """(saved, cached) bf16 copies of the linear weights and biases under autocast (the norms
    run in fp32 and are not cast)."""
    if not c.amp:
        return 0, 0
    w = sum(t(p.numel, 2) for p in layer.params if p.name.startswith(LINEAR_PARTS)
            or p.name.startswith("mlp."))
    return w, (w if need_w else 0)


def _lse_rows(c: Ctx, length: int) -> int:
    """Logsumexp rows of one attention segment (`attention_core`'s rule)."""
    if c.e == FP32 and c.attn != "flash_attention_2":
        return -(-length // LSE_ALIGN_EFFICIENT) * LSE_ALIGN_EFFICIENT
    return length


def _norm(sv: Saved, c: Ctx, n: int, h: int, rms: bool, need_w: bool) -> None:
    """What norm1 / norm2 / ln_q save of an (n, h) input in the stream dtype `c.e`."""
    if rms:
        sv.add(n * h, FP32)           # `.to(float32)` (the input itself when fp32)
        sv.add(n, FP32)               # rsqrt
        sv.add(n * h, c.e, need_w)    # `hidden.to(input_dtype)` for the weight grad
    else:
        sv.add(n * h, FP32 if c.amp else c.e)  # input (CUDA autocast: its fp32 cast)
        sv.add(n, FP32, times=2)      # mean, rstd


def norm_out_bytes(c: Ctx) -> int:
    """Bytes per element of a norm's output: fp32 under autocast (fp32 LayerNorm; RMSNorm's
    fp32 weight times a bf16 tensor), else the compute dtype."""
    return FP32 if c.amp else c.e


def vision_block(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    d = layer.dims
    N, h, f, heads, rms = d["n"], d["h"], d["ffn"], d["heads"], d["rms"]
    if not (need_in or need_w) or not layer.runs or N == 0:
        return Acts()
    e, no = c.e, norm_out_bytes(c)
    sv = Saved()
    _norm(sv, c, N, h, rms, need_w)
    linear_inputs(sv, c, N * h, no, 1, need_w, 0, shared=False)   # qkv input
    sv.add(N * 3 * h, e)              # qkv output (v is a view of it)
    sv.add(N * h, e, times=2)         # rotated q, k
    sv.add(N * h, e)                  # SDPA outputs of all segments
    sv.add(heads * sum(_lse_rows(c, L) for L in d["segments"]), FP32)  # logsumexp
    linear_inputs(sv, c, N * h, e, 1, need_w, 0, shared=False)    # cat -> proj input
    attn_part = sv.total
    _norm(sv, c, N, h, rms, need_w)
    gated = "mlp.gate_proj.weight" in {p.name for p in layer.params}
    if gated:
        linear_inputs(sv, c, N * h, no, 2, need_w, 0, shared=False)  # gate / up inputs
        sv.add(N * f, e, times=3)     # gate output (SiLU input), SiLU output, up output
    else:
        linear_inputs(sv, c, N * h, no, 1, need_w, 0, shared=False)  # fc1 input
        sv.add(N * f, e, times=2 if d["act"] in TWO_TENSOR_ACTS else 1)
    sv.add(N * f, e, need_w)          # down_proj / fc2 input
    copies, cache = _amp_weights(layer, c, need_w)
    # forward: rope's fp32 q, k (copies when not fp32) and rotate_half / product temporaries
    fwd_parts = (t(N * h, FP32),) * (4 if e != FP32 else 2)
    bwd_parts = (t(N * h, e), t(N * h, e), *[t(N * h, e)] * 3)
    bwd_mlp_parts = (t(N * h, e), t(N * f, e), t(N * f, e))
    return Acts(saved=sv.total + copies, parts=(copies, *sv.sizes), ckpt_saved=t(N * h, e),
                cache=cache, fwd_extra=sum(fwd_parts), bwd_extra=sum(bwd_parts),
                mlp_saved=sv.total - attn_part, bwd_mlp=sum(bwd_mlp_parts),
                fwd_parts=fwd_parts, bwd_parts=bwd_parts, bwd_mlp_parts=bwd_mlp_parts)


def patch_embed(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """Conv3d over (N, C, T, P, P) views of pixel_values: saves its input for the weight grad
    (the batch tensor itself; autocast's bf16 copy of it). Output: the stream (N, E)."""
    d = layer.dims
    N, h = d["n"], d["h"]
    if not layer.runs or N == 0:
        return Acts()
    saved = t(N * d["row"], 2) if c.amp and need_w else 0
    copies = t(layer.num_params, 2) if c.amp and need_w else 0
    return Acts(saved=saved + copies, cache=copies, fwd_extra=t(N * h, c.e),
                bwd_extra=t(N * h, c.e) if need_w else 0)


def vision_rotary(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """cos, sin (N, head_dim) fp32, made once per forward, saved by every block's rope."""
    d = layer.dims
    if not layer.runs or not need_in or d["n"] == 0:
        return Acts()
    return Acts(saved=2 * t(d["n"] * d["head_dim"], FP32),
                fwd_extra=t(d["n"] * 2, 8) + 2 * t(d["n"] * d["head_dim"] // 2, FP32))


def patch_merger(layer: Layer, c: Ctx, need_in: bool, need_w: bool) -> Acts:
    """ln_q, view to (N/m², E·m²), Linear - GELU - Linear. Its output stays referenced by
    `image_outputs.pooler_output` (split views) until the forward returns."""
    d = layer.dims
    N, h, out, rms = d["n"], d["h"], d["out"], d["rms"]
    if not layer.runs or N == 0:
        return Acts()
    e = c.e
    held = t(d["tokens"] * out, e)
    if not (need_in or need_w):
        return Acts(held=held)
    sv = Saved()
    _norm(sv, c, N, h, rms, need_w)
    linear_inputs(sv, c, N * h, norm_out_bytes(c), 1, need_w, 0, shared=False)  # mlp.0 input
    sv.add(N * h, e)                  # GELU input
    sv.add(N * h, e, need_w)          # mlp.2 input
    copies, cache = _amp_weights(layer, c, need_w)
    return Acts(saved=sv.total + copies, parts=(copies, *sv.sizes), cache=cache,
                fwd_extra=t(d["tokens"] * out, e) + (t(d["tokens"] * out, FP32) if c.amp else 0),
                bwd_extra=2 * t(N * h, e), held=held)


def pixel_bytes(layer: Layer, graph, pix: int) -> int:
    """`LayerKind.pixel_bytes`: the processor's flattened patches (n, row) in the model dtype
    and `image_grid_thw` (images, 3) int64 (`Family.pixel_inputs`)."""
    if not graph.image_tokens:
        return 0
    d = layer.dims
    return t(d["n"] * d["row"], pix) + t(3 * d["images"], INT64)

