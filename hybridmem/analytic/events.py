"""An approximate alloc/free stream of two training iterations, built from the priced layers.

Why: reserved memory (segments the caching allocator holds) depends on the ORDER and SIZES of
allocations, not only on their sum; the closed form gives the sum. This stream follows the
same timeline as `timeline.walk` (the loop in its docstring), tensor by tensor where the
analytic model knows the tensors, so `reserved.py` can replay it through the
caching-allocator simulator the trace tier also uses (`hybridmem.allocator`):
- setup: every parameter / buffer / LoRA tensor (and bf16-master fp32 copies), a separate
  reference model's copy of them (DPO / KTO / GRPO `ref_model="separate"`), the batch;
- forward, per layer: its saved tensors (`Acts.parts`, in forward order) with its transient
  tensors (`Acts.fwd_parts`; bytes a formula sums without listing are cut into tensors of the
  layer's hidden-state size) alive over the second half; a checkpointed layer runs under
  no_grad (working set: `no_grad_working_set` and the transients) and keeps its input
  (`ckpt_saved`) and autocast's cache; the tied embedding's grad is accumulated out of place;
- backward, last layer first: recompute (checkpointing), the MLP half then the attention half
  (their transients, grads allocated per parameter as they are produced, the MLP's saved
  tensors freed in between), then the layer's remaining saved tensors are freed;
- optimizer: bf16-master fp32 grads (made per layer, each bf16 grad freed after its copy);
  iteration 0 creates the state lazily, per parameter in order (torch/optim/adam.py
  `_init_group`: exp_avg then exp_avg_sq); then the step's temporaries: foreach AdamW
  (`_multi_tensor_adam`) makes `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`, one
  tensor per parameter of a (device, dtype) group, all alive until the group's update ends;
  adafactor one `row_var @ col_var` per >= 2-D parameter at a time; lion two clones per
  parameter at a time; fused/8-bit/SGD none; then zero_grad(set_to_none=True) frees the grads.
- the loop (`timeline` docstring): `grad_accum` micro-steps, later ones making each grad as a
  transient; `clip_grad_norm_`'s temporaries between the backward and the step; under the
  custom loop the logits (taken out of the lm_head's forward transients), what layers hold
  for the output object and the loss stay allocated until the next forward has returned;
  `empty_cache_steps` > 0 adds ("empty_cache", 0, 0) where `spec.empty_cache_at` says (after
  the forward under Trainer, after the step before zero_grad under the custom loop).

Approximations (documented, not hidden): what the formulas sum without listing (autocast
weight copies, LoRA / flash-attention extras) is one or a few tensors; the order of ops inside
a layer, and temporaries the closed form does not count (e.g. RMSNorm's fp32 upcasts in
backward), are not modelled. Measured against the trace tier's recorded stream replayed
through the same simulator: experiments/analytic_vs_trace.py.
"""

from __future__ import annotations

from hybridmem.allocator.alloc import t
from hybridmem.allocator.foreach import foreach_norm_scratch
from hybridmem.analytic.states import state_bytes
from hybridmem.job.precision import casts_weights
from hybridmem.objectives import ref_model_of
from hybridmem.job.optimizers import rule
from hybridmem.techniques.quantize import quant_of
from hybridmem.job.spec import POLICIES, TrainingSpec, empty_cache_at

# parameters of a transformer layer's MLP half (its grads appear first in backward);
# estimate._mlp_grads uses the same split
MLP_ALL = ("mlp.", "post_attention_layernorm.", "layer_norm2.")


class Stream:
    """Collects ("alloc", key, size) / ("free", key, 0) events with fresh integer keys."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int]] = []
        self.sizes: list[int] = []

    def alloc(self, size: int) -> int | None:
        if size <= 0:
            return None
        key = len(self.sizes)
        self.sizes.append(size)
        self.events.append(("alloc", key, size))
        return key

    def allocs(self, sizes) -> list[int]:
        return [k for k in map(self.alloc, sizes) if k is not None]

    def free(self, keys) -> None:
        self.events += [("free", k, 0) for k in keys if k is not None]

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()` (`hybridmem.allocator.replay` reads this event)."""
        self.events.append(("empty_cache", 0, 0))


def chunks(total: int, unit: int) -> list[int]:
    """`total` bytes as tensors of `unit` bytes (+ the remainder): a summed transient."""
    if total <= 0:
        return []
    if unit <= 0 or unit >= total:
        return [total]
    n, rest = divmod(total, unit)
    return [unit] * n + ([rest] if rest else [])


def split(total: int, listed, unit: int) -> list[int]:
    """A transient of `total` bytes as the tensors its formula `listed`, the rest (bytes it
    summed without listing: LoRA / flash-attention extras) as tensors of `unit` bytes."""
    listed = [x for x in listed if x > 0]
    rest = total - sum(listed)
    if rest < 0:
        return chunks(total, unit)
    return listed + chunks(rest, unit)


def _parts(acts) -> list[int]:
    """The saved tensors of a layer; bytes the formula did not list count as one tensor."""
    parts = [p for p in acts.parts if p > 0]
    rest = acts.saved - sum(parts)
    if rest > 0:
        parts.append(rest)
    return parts


def _recomputed_parts(acts) -> list[int]:
    """The saved tensors a checkpointed layer's recompute makes: `_parts` less the input the
    checkpoint hands it (`Acts.recomputed`)."""
    parts = _parts(acts)
    alias = acts.saved - acts.recomputed
    if alias in parts:
        parts.remove(alias)
    return parts


def no_grad_working_set(layer, acts, amp: bool) -> list[int]:
    """Tensors alive together at the high point of a checkpointed layer's no_grad forward.

    Under no_grad each op's output is freed once consumed; the high point is the gated MLP
    (`act_fn(gate_proj(x)) * up_proj(x)`: activation output, up output and their product,
    the three largest activations) plus, under autocast, the cast copy of the weight in use
    (not cached: autocast caches only leaves that require grad). Measured on llava-1.5-7b
    LoRA bf16-mixed (trace tier): ~400-470 MiB per decoder layer, this gives 344 MiB + RoPE.
    """
    # parts[0] of the checkpointed kinds (decoder_layer, encoder_layer): the weight copies
    acts_only = sorted(acts.parts[1:] if acts.parts else ())
    out = acts_only[-3:]
    if amp and layer.params:
        out.append(t(max(q.numel for q in layer.params), 2))
    return out


def _forward_with_grad(s: Stream, parts: list[int], extra: list[int], after: int = 0
                       ) -> list[int]:
    """A layer's forward under autograd: the first half of its saved tensors, its transients
    (alive over the second half), the second half; returns the saved tensors' keys. `after`
    (`Acts.fwd_after_top`, eager attention): the transients come before the last tensors
    holding those bytes, the layer's second half."""
    half = len(parts) // 2
    if after > 0:
        half, tail = len(parts), 0
        while half > 0 and tail + parts[half - 1] <= after:
            half -= 1
            tail += parts[half]
    keys = s.allocs(parts[:half])
    tmp = s.allocs(extra)
    keys += s.allocs(parts[half:])
    s.free(tmp)
    return keys


def _grad_sizes(p, policy) -> tuple[list[int], list[int], int]:
    """Grad tensors of a layer in the order backward makes them: (MLP half, the rest, tie).

    Tied embeddings: the shared weight's grad is made at lm_head (tie > 0: its size, the last
    of `rest`) and replaced at the embedding's backward (tie < 0), where autograd accumulates
    `old + new` into a new tensor (`AccumulateGrad`, out of place when the grad exists)."""
    layer = p.layer
    mlp, rest = [], []
    for q in reversed(layer.grad_tensors):
        (mlp if q.name.startswith(MLP_ALL) else rest).append(t(q.numel, q.itemsize or
                                                               policy.grad_bytes))
    diff = p.step.grad - sum(mlp) - sum(rest)  # tied embeddings: the grad moves to lm_head
    if diff < 0 and -diff in rest:
        rest.remove(-diff)
    elif diff < 0 and -diff in mlp:
        mlp.remove(-diff)
    elif diff > 0:
        rest.append(diff)
    elif diff < 0:
        return [], chunks(p.step.grad, p.step.grad), 0
    return mlp, rest, diff


def _setup_sizes(layer, policy, quant) -> list[int]:
    """The tensors a layer holds from setup on, as `states.layer_states` prices them: a
    quantised weight is the tensors bitsandbytes keeps (`Quant.weight_allocs`), any other
    tensor its own dtype or the policy's."""
    sizes = []
    for q in layer.params:
        if q.name in layer.quantized:
            sizes += [t(a.numel, a.itemsize) for a in quant.weight_allocs(*q.shape)]
        else:
            sizes.append(t(q.numel, q.itemsize or policy.param_bytes))
    return sizes + [t(q.numel, q.itemsize or policy.param_bytes)
                    for q in (*layer.buffers, *layer.lora, *layer.copies)]


def build(priced, spec: TrainingSpec, statics, iterations: int = 2,
          marks: list | None = None) -> list[tuple]:
    """The event stream of `iterations` training iterations (see the module docstring).

    `marks`, if given, receives (event index, phase, iteration) at each phase start, as the
    trace tier's `TraceResult.marks` (for comparing the two streams)."""
    mark = (lambda ph, it: marks.append((len(s.events), ph, it))) if marks is not None \
        else (lambda ph, it: None)
    policy = POLICIES[spec.precision]
    amp = casts_weights(spec.precision)
    s = Stream()
    quant = quant_of(spec)
    for p in priced:  # setup: parameters, buffers, adapters; fp32 masters
        s.allocs(_setup_sizes(p.layer, policy, quant))
    if ref_model_of(spec) == "separate":  # the reference's deep copy of the same tensors
        for p in priced:  # (objectives.reference_param_bytes: what the closed form adds)
            s.allocs(_setup_sizes(p.layer, policy, quant))
    if policy.master_bytes:
        for p in priced:
            if p.layer.trainable:
                s.allocs(t(q.numel, policy.master_bytes) for q in p.layer.params)
    s.alloc(statics.inputs)
    stepped = [x for p in priced for x in p.states.stepped]
    grads: list[list[int]] = [[] for _ in priced]
    output: list[int] = []  # the custom loop's output object (the previous micro-step's)
    for it in range(iterations):
        where = empty_cache_at(spec, it)
        for micro in range(statics.grad_accum):
            mark("forward", it)
            if it == 0 and micro == 0:
                s.alloc(statics.workspace_first)
            saved, kept, new_output = _forward(s, priced, statics, amp)
            s.free(output)  # `outputs = model(**batch)`: the previous object dies here
            output = new_output
            mark("backward", it)
            if where == "after_forward":  # Trainer.training_step: after compute_loss
                s.empty_cache()
            if it == 0 and micro == 0:
                s.alloc(statics.workspace - statics.workspace_first)
            if micro == 0:
                step = _stepper(s, priced, spec.optimizer, it) if statics.in_backward else None
                _backward(s, priced, policy, saved, kept, grads, step)
            else:
                _accumulating_backward(s, priced, policy, saved, kept)
            output += s.allocs([statics.loss])  # the loss outlives backward with the output
        mark("optimizer", it)
        if policy.master_bytes:  # master.grad = param.grad.float(), per layer
            for i, p in enumerate(priced):
                new = s.allocs(t(x.numel, 4) for x in p.states.stepped)
                s.free(grads[i])
                grads[i] = new
        if statics.clip_temp:
            _clip_temporaries(s, stepped)
        if it == 0 and not statics.in_backward:
            for x in stepped:
                s.allocs(state_bytes(x, spec.optimizer))
        if not statics.in_backward:  # optimizer-in-backward: the hooks stepped already
            _optimizer_temporaries(s, spec.optimizer, stepped)
        if where == "after_step":  # the peft benchmark: after the step, grads still alive
            s.empty_cache()
        for g in grads:  # zero_grad(set_to_none=True)
            s.free([k for k in g if k is not None])
        grads = [[] for _ in priced]
    return s.events


def _forward(s: Stream, priced, statics, amp: bool):
    """One forward: (saved keys, checkpointed inputs' keys, per layer; the keys the output
    object keeps: the logits, what layers hold for it (`Step.held_by_output`), custom loop
    only, else [])."""
    kept: list[list[int]] = [[] for _ in priced]
    saved: list[list[int]] = [[] for _ in priced]
    drop_at_end: list[int] = []
    output: list[int] = []
    held = output if statics.custom else drop_at_end
    for i, p in enumerate(priced):
        a, st = p.step.acts, p.step
        unit = a.ckpt_saved or max(a.parts, default=0)
        extra = split(a.fwd_extra, a.fwd_parts, unit)
        if p.layer.kind == "lm_head" and statics.logits:
            held_logits = _logit_parts(extra, statics.logits)
            for x in held_logits:  # the logits outlive the forward with the output
                extra.remove(x)
            output += s.allocs(held_logits)
        if st.on_path and st.ckpt:
            # no_grad: intermediates die as soon as they are consumed; only the working
            # set at the layer's high point and then its output are allocated
            s.free(s.allocs(no_grad_working_set(p.layer, a, amp) + extra))
            kept[i] = s.allocs([a.ckpt_saved])
            drop_at_end += s.allocs([a.cache])
        else:
            saved[i] = _forward_with_grad(s, _parts(a), extra, a.fwd_after_top)
            if not st.on_path:
                held += saved[i]
                saved[i] = []
        held += s.allocs([a.held])
    s.free(drop_at_end)
    return saved, kept, output


def _logit_parts(extra: list[int], logits: int) -> list[int]:
    """The lm_head's forward tensors that are the logits (`logits` bytes): one tensor, or the
    leading N chunks of `--chunked-ce` (common.decoder_acts.chunked_head lists them first)."""
    if logits in extra:
        return [logits]
    total = 0
    for n, x in enumerate(extra):
        total += x
        if total == logits:
            return extra[:n + 1]
        if total > logits:
            break
    return []


def _stepper(s: Stream, priced, optimizer: str, iteration: int):
    """Optimizer-in-backward (`hybridmem.techniques.optim_in_backward`): `step(i, keys)` steps the
    layer's parameters whose grads `keys` were just made, one at a time: its state (iteration 0,
    made by the first step), one parameter's temporaries, then `zero_grad` frees the grad."""
    made: set[int] = set()

    def step(i: int, keys: list[int]) -> None:
        stepped = priced[i].states.stepped
        if iteration == 0 and i not in made:
            made.add(i)
            for x in stepped:
                s.allocs(state_bytes(x, optimizer))
        for k in keys:  # the layer's largest one-parameter step temporary (estimate.price)
            s.free(s.allocs([priced[i].step.step_temp]))
            s.free([k])

    return step


def _backward(s: Stream, priced, policy, saved, kept, grads, step=None) -> None:
    """The first micro-step's backward: grads allocated as they are produced; `step`
    (optimizer-in-backward, `_stepper`) steps and frees them as they are made."""
    tied = None
    for i in reversed(range(len(priced))):
        p = priced[i]
        a, st = p.step.acts, p.step
        mlp_g, rest_g, tie = _grad_sizes(p, policy)
        if not st.on_path:
            grads[i] = s.allocs(mlp_g + rest_g)
            continue
        unit = a.ckpt_saved or max(a.parts, default=0)
        if st.ckpt:  # recompute
            saved[i] = _forward_with_grad(s, _recomputed_parts(a),
                                          split(a.fwd_extra, a.fwd_parts, unit))
        if a.bwd_mlp:
            tmp = s.allocs(split(a.bwd_mlp, a.bwd_mlp_parts, unit))
            grads[i] = s.allocs(mlp_g)
            if step is not None:
                step(i, grads[i])
                grads[i] = []
            s.free(tmp)
            _free_mlp_saved(s, saved[i], a.mlp_saved)
            # eager: o_proj's input, v, the probs cast (the attention half's last tensors)
            _free_mlp_saved(s, saved[i], a.bwd_top_freed)
        else:
            rest_g = mlp_g + rest_g
        tmp = s.allocs(split(a.bwd_extra, a.bwd_parts, unit))
        early = _take_saved(s, saved[i], a.grad_in_saved, rest_g)
        new_g = s.allocs(rest_g) + early
        grads[i] += new_g
        if tie > 0:
            tied = (i, len(grads[i]) - 1)
        elif tie < 0 and tied is not None:  # the tied grad: old + new, then old freed
            new = s.alloc(-tie)
            s.free([grads[tied[0]][tied[1]]])
            grads[tied[0]][tied[1]] = new
            if step is not None:  # the tied weight is stepped once, here
                step(i, [new])
                grads[tied[0]][tied[1]] = None
        if step is not None:  # a tied lm_head grad waits in autograd's buffer (not stepped)
            step(i, new_g[:-1] if tie > 0 else new_g)
            grads[i] = grads[i][-1:] if tie > 0 else []
        s.free(tmp)
        s.free(saved[i])
        s.free(kept[i])
        saved[i], kept[i] = [], []


def _accumulating_backward(s: Stream, priced, policy, saved, kept) -> None:
    """A later micro-step's backward: each new grad is made, added in place into the live one
    and freed (AccumulateGrad); a tied weight's lm_head grad waits in autograd's input buffer
    until the embedding's backward."""
    pending: list[int] = []
    for i in reversed(range(len(priced))):
        p = priced[i]
        a, st = p.step.acts, p.step
        if not st.on_path:
            continue
        mlp_g, rest_g, tie = _grad_sizes(p, policy)
        rest_g = list(rest_g)
        early = _take_saved(s, saved[i], a.grad_in_saved, rest_g)  # freed with `saved` below
        if tie > 0 and early:
            pending += early
        elif tie > 0:
            rest_g.remove(tie)
            pending += s.allocs([tie])
        unit = a.ckpt_saved or max(a.parts, default=0)
        if st.ckpt:
            saved[i] = _forward_with_grad(s, _recomputed_parts(a),
                                          split(a.fwd_extra, a.fwd_parts, unit))
        if a.bwd_mlp:
            tmp = s.allocs(split(a.bwd_mlp, a.bwd_mlp_parts, unit))
            for g in mlp_g:
                s.free([s.alloc(g)])
            s.free(tmp)
            _free_mlp_saved(s, saved[i], a.mlp_saved)
            # eager: o_proj's input, v, the probs cast (the attention half's last tensors)
            _free_mlp_saved(s, saved[i], a.bwd_top_freed)
        else:
            rest_g = mlp_g + rest_g
        tmp = s.allocs(split(a.bwd_extra, a.bwd_parts, unit))  # a tied weight's new grad
        for g in rest_g if tie >= 0 else ():
            s.free([s.alloc(g)])
        if early and tie <= 0:  # added into the live grad, then dropped
            s.free(early)
        if tie < 0:
            s.free(pending)
            pending = []
        s.free(tmp)
        s.free(saved[i])
        s.free(kept[i])
        saved[i], kept[i] = [], []


def _take_saved(s: Stream, keys: list[int], nbytes: int, grads: list[int]) -> list[int]:
    """A weight grad made in the forward (`Acts.grad_in_saved`, Liger's FLCE): its saved
    tensor's key, moved out of `keys`, and its size out of `grads` (it is not allocated again)."""
    if nbytes <= 0:
        return []
    key = next((k for k in keys if s.sizes[k] == nbytes), None)
    if key is None or nbytes not in grads:
        return []
    keys.remove(key)
    grads.remove(nbytes)
    return [key]


def _free_mlp_saved(s: Stream, keys: list[int], nbytes: int) -> None:
    """Free the MLP's saved tensors (the last ones the forward made) before the attention's
    backward."""
    freed = 0
    while keys and freed < nbytes:
        key = keys.pop()
        s.free([key])
        freed += s.sizes[key]


def _clip_temporaries(s: Stream, stepped) -> None:
    """`clip_grad_norm_(foreach=True)`'s tensors in order (`states.clip_temporary`)."""
    groups: dict[int, list] = {}
    for x in stepped:
        groups.setdefault(x.state, []).append(x)
    norms: list[int] = []
    for size, group in groups.items():
        scratch = s.allocs(t(n, 4) for n in foreach_norm_scratch([x.numel for x in group]))
        norms += s.allocs([t(1, size)] * len(group))
        s.free(scratch + s.allocs([t(1, size)]))  # + the unused 0-dim global_norm
    stacked = s.allocs([t(len(stepped), max(groups))])
    total = s.allocs([t(1, max(groups))])
    s.free(stacked + norms)
    s.free(s.allocs([t(1, 4)] * 3) + total)  # clip coefficients, then the total norm


def _optimizer_temporaries(s: Stream, optimizer: str, stepped) -> None:
    """The step's temporaries in the optimizer rule's order (`job.optimizers`,
    `Rule.temporary_stream`): each group allocated, then freed before the next."""
    for group in rule(optimizer).temporary_stream(stepped, t):
        s.free(s.allocs(t(*a) for a in group))