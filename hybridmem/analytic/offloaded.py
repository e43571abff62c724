"""Activation offloading in the analytic tier: what each layer keeps on the GPU.

The rules are `hybridmem.techniques.offload`'s (its hooks `offload_hooks`) (TRL `OffloadActivations` for `all`, transformers'
checkpoint `offload=True` for `ckpt-inputs`); here they become per-layer `Step`s for the
timeline (`timeline.walk`):

- a checkpointed layer's input (`Acts.ckpt_saved`, saved by the checkpoint itself) leaves the
  GPU after the layer's forward and comes back for its recompute (both variants);
- `all`, a layer that is not checkpointed: each saved tensor of >= `MIN_OFFLOAD_SIZE` bytes
  (`Acts.parts`) leaves the GPU; autocast's cached weight copies stay until the forward ends
  (the cache holds the device copy, `Step.fwd_only`). In flight: in forward the last
  `MAX_FWD_STASH_SIZE` offloaded tensors (the forward stash; priced as the largest run of
  that many consecutive parts of the layer, on top of its forward transients), in backward the
  tensors of the node running and of the previous one (the double buffer; priced as the largest
  run of `BWD_IN_FLIGHT` consecutive parts, on top of each backward stage's transients);
- the steps after the last decoder layer (final norm, lm_head with the loss) are left as they
  are: TRL keeps the lm_head's saved tensors on the GPU (`NoOpManager`), and the final norm's
  and the loss's are the last ones packed, still in the forward stash when backward starts.

A storage saved by two ops stays on the GPU under TRL (its dedup keeps the second save's
device reference): `Acts.shared` (the decoder layer's RMSNorm fp32 inputs) is kept.
"""

from __future__ import annotations

from dataclasses import replace

from hybridmem.allocator.alloc import t
from hybridmem.analytic.timeline import Step
from hybridmem.techniques.kernels import MAX_FWD_STASH_SIZE, MIN_OFFLOAD_SIZE
from hybridmem.techniques.offload import STUCK

# One backward node saves up to 5 tensors (SDPA: q, k, v, out, logsumexp; derivatives.yaml);
# two nodes' worth are on the GPU at once (trl activation_offloading.py: `prev_node_ids` are
# freed in the next node's hook).
BWD_IN_FLIGHT = 6


def _window(parts: list[int], n: int) -> int:
    """Largest sum of `n` consecutive entries (all of them if fewer)."""
    if len(parts) <= n:
        return sum(parts)
    return max(sum(parts[i:i + n]) for i in range(len(parts) - n + 1))


def apply(priced: list, spec) -> list:
    """`priced` (estimate.Priced rows) with offloading applied to their steps."""
    mode = spec.offload_activations
    if mode == "none":
        return priced
    layers = [i for i, p in enumerate(priced) if p.layer.kind == "decoder_layer"]
    last = layers[-1] if layers else len(priced)
    return [replace(p, step=_step(p.step, mode, _norm_input(p.layer))) if i <= last else p
            for i, p in enumerate(priced)]


def _norm_input(layer) -> int:
    """Bytes of a decoder layer's RMSNorm fp32 input (the size `Acts.shared` counts in)."""
    d = layer.dims
    return t(d["b"] * d["s"] * d["h"], 4) if layer.kind == "decoder_layer" else 0


def _step(s: Step, mode: str, norm_input: int = 0) -> Step:
    a = s.acts
    if not s.on_path or not a.saved:
        return s
    if s.ckpt:  # the checkpoint's saved input: off after the forward, back for the recompute
        if a.ckpt_saved < MIN_OFFLOAD_SIZE and mode == "all":
            return s
        back = a.ckpt_saved
        return replace(s, acts=replace(
            a, ckpt_saved=0, bwd_extra=a.bwd_extra + back, bwd_parts=(*a.bwd_parts, back),
            bwd_mlp=a.bwd_mlp + back if a.bwd_mlp else 0,
            bwd_mlp_parts=(*a.bwd_mlp_parts, back) if a.bwd_mlp else a.bwd_mlp_parts))
    if mode != "all":
        return s
    parts = list(a.parts) or [a.saved]
    rest = a.saved - sum(parts)  # bytes not listed: one tensor
    if rest:
        parts.append(rest)
    kept = list(parts)
    for _ in range(a.shared // norm_input if norm_input else 0):  # kept by TRL's dedup
        if norm_input in parts:
            parts.remove(norm_input)
    off = [x for x in parts if x >= MIN_OFFLOAD_SIZE]
    stay = a.saved - sum(off)
    cache = min(a.cache, sum(off))  # autocast's cached copies: on the GPU until forward end
    fwd = _window(off, MAX_FWD_STASH_SIZE)
    bwd = _window(off, BWD_IN_FLIGHT)
    for x in off:  # in place, as 0: events.py reads parts[0] as the weight copies
        kept[kept.index(x)] = 0
    # the allocator replay (events.py) sees the kept parts, the in-flight runs as one tensor each
    acts = replace(a, saved=stay, mlp_saved=min(a.mlp_saved, stay), parts=tuple(kept),
                   fwd_extra=a.fwd_extra + fwd, fwd_parts=(*a.fwd_parts, fwd),
                   bwd_extra=a.bwd_extra + bwd, bwd_parts=(*a.bwd_parts, bwd),
                   bwd_mlp=a.bwd_mlp + bwd if a.bwd_mlp else 0,
                   bwd_mlp_parts=(*a.bwd_mlp_parts, bwd) if a.bwd_mlp else a.bwd_mlp_parts)
    return replace(s, acts=acts, fwd_only=cache)


def notes(priced: list, spec) -> tuple[str, ...]:
    """What the user should read about offloading in this spec."""
    if spec.offload_activations == "none":
        return ()
    out = [f"offload {spec.offload_activations}: saved activations in pinned host memory "
           "(not counted here; hybridmem.techniques.offload)"]
    if spec.offload_activations == "all" and any(
            not p.step.on_path and p.step.acts.saved for p in priced):
        out.append(STUCK + "not priced by the analytic tier: use --method trace")
    return tuple(out)
