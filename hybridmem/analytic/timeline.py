"""The peak over a timeline of one training step, for the first and a later iteration.

The loop priced is transformers Trainer's: `loss = model(**batch).loss; loss.backward();
[clip_grad_norm_]; opt.step(); opt.zero_grad(set_to_none=True)`, with the spec's loop
(`Statics.custom`, `Statics.grad_accum`, `Statics.clip_temp`). So:
- forward: activations accumulate layer by layer (checkpointed layers keep only their input;
  autocast's cached weight copies live until the forward ends);
- backward, last layer first: a layer's grads appear, its saved tensors (recomputed first when
  checkpointed: the recompute's top, `Acts.recompute_extra`, with the output's grad waiting)
  and its backward transients are live, then its saved tensors are freed;
- grad accumulation: `grad_accum` forward/backward micro-steps per step; from the second on
  all grads are live through the backward and each new grad is a transient (AccumulateGrad
  adds it in place, torch/csrc/autograd/functions/accumulate_grad.h); a tied weight's grad
  from lm_head waits in autograd's input buffer until the embedding's backward;
- clipping (`max_grad_norm`): all grads + `clip_temp` (the foreach norms), before the state
  exists in iteration 0 (it is created inside the first `step`);
- optimizer step: all grads + the state, created lazily in the first step (so iteration 0's
  forward/backward run without it) + the step's temporaries; then the grads are freed.
- custom loop (`outputs = model(**batch)`, huggingface/peft MetaMathQA/run.py): the output
  object (logits, loss; LLaVA's image features and the unused vision layer's graph they
  reach, `Step.held_by_output`) lives until the next forward returns.
The batch (ids, labels, pixels; no attention mask) lives for the whole iteration. Each point of the timeline
carries its bytes per category, so the breakdown at the peak is exact, not a sum of maxima.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridmem.families.common.activations import Acts


@dataclass(frozen=True, slots=True)
class Step:
    """One layer as the timeline sees it."""

    acts: Acts
    ckpt: bool
    grad: int
    """Grad bytes that appear when this layer runs backward."""
    grad_waste: int = 0
    grad_mlp: tuple[int, int] = (0, 0)
    """(grads made by the MLP's output projection, by the whole MLP half): a transformer layer's
    backward runs MLP first, attention second; its grads appear stage by stage."""
    on_path: bool = True
    """Saved tensors are kept for backward (False: the layer's output is never used)."""
    grad_max: tuple[int, int] = (0, 0)
    """Largest grad tensor made by (the MLP half, the rest): the transient of an accumulating
    micro-step's backward."""
    tie: int = 0
    """Tied embeddings: +bytes of the shared weight's grad at lm_head, - at the embedding."""
    state: int = 0
    """Optimizer state of this layer's parameters (created lazily by their first step)."""
    step_temp: int = 0
    """Largest temporary of one parameter's step (optimizer-in-backward steps one at a time)."""
    fwd_only: int = 0
    """Bytes kept on the GPU only until the forward ends (activation offloading: autocast's
    cache holds the device copy of an offloaded weight cast; `analytic.offloaded`)."""

    @property
    def held_by_output(self) -> int:
        """Bytes the model's output object keeps alive (`held`; an unused layer's saved
        tensors, reachable through the graph of what it holds)."""
        return self.acts.held + (0 if self.on_path else self.acts.saved)

    @property
    def kept(self) -> int:
        """Bytes this layer leaves alive after its forward."""
        if not self.on_path:
            # output unused, but the model's output object (`image_outputs`) holds it and
            # its autograd graph until the forward returns
            return self.acts.saved + self.acts.held
        kept = (self.acts.ckpt_saved + self.acts.cache) if self.ckpt else self.acts.saved
        return kept + self.acts.held + self.fwd_only

    @property
    def released_at_forward_end(self) -> int:
        if not self.on_path:
            return self.acts.saved + self.acts.held
        return (self.acts.cache if self.ckpt else 0) + self.acts.held + self.fwd_only


@dataclass(frozen=True, slots=True)
class Point:
    phase: str
    iteration: int
    bytes: dict[str, int]
    waste: int = 0
    """Segment rounding of the persistent tensors alive here (a fragmentation lower bound)."""
    step: int = -1
    """Index of the step (layer) running at this point; -1 outside the layers (the step,
    GRPO's generation, a reference forward). Read by per-layer state rules (FSDP2's
    gathered units, `parallel.fsdp_points`)."""

    @property
    def allocated(self) -> int:
        return sum(self.bytes.values())


@dataclass(frozen=True, slots=True, kw_only=True)
class Statics:
    param: int
    master: int
    """Optimizer bytes present from initialisation (fp32 master weights)."""
    state: int
    """Optimizer state created lazily in the first step."""
    opt_temp: int
    inputs: int
    workspace_first: int
    """Kernel workspaces during iteration 0's forward (one cuBLAS handle)."""
    workspace: int
    """Kernel workspaces from the first backward on (a second handle on the autograd thread)."""
    waste_param: int = 0
    waste_optimizer: int = 0
    master_grads: int = 0
    """bf16-master: fp32 grads of the master copies, made from the bf16 grads (which are then
    dropped) right before the step; 0 when the optimizer steps the parameters themselves."""
    custom: bool = False
    """`loop="custom"`: the output object outlives the forward (module docstring)."""
    logits: int = 0
    """Bytes of the logits the output object holds (`loop="custom"`)."""
    loss: int = 0
    """Bytes of the loss the output object holds after backward (`loop="custom"`; the
    lm_head's formula frees its nll_loss output at its backward)."""
    grad_accum: int = 1
    clip_temp: int = 0
    """Peak of `clip_grad_norm_`'s temporaries (0: no clipping)."""
    ref_forward: int = 0
    """The reference model's no-grad forward at the end of the policy's forward (DPO's
    `compute_ref_log_probs`, `analytic.objectives`): its high point, a transient there."""
    generation: int = 0
    """GRPO's generation phase (`analytic.objectives.generation`): its high point's
    temporaries (KV cache and sampling, then the reference's log-probs), once per step before
    the first micro-step; 0 for the other objectives."""
    generation_held: int = 0
    """What the generation phase leaves alive until the step ends (the completions' ids, the
    advantages, the reference's log-probs), part of `inputs`."""
    in_backward: bool = False
    """Optimizer-in-backward (`hybridmem.techniques.optim_in_backward`): each parameter is stepped
    and its grad freed inside backward; the optimizer phase steps nothing."""


@dataclass
class _Walk:
    st: Statics
    iteration: int
    points: list[Point] = field(default_factory=list)
    current: int = -1
    """The step whose points are being made (`Point.step`)."""

    def point(self, phase: str, act: int, temp: int, grad: int, grad_waste: int,
              extra_opt: int = 0, state: bool = True) -> None:
        # the state exists from the first optimizer step on (created lazily inside it)
        later = self.iteration > 0 or (phase == "optimizer" and state)
        ws = self.st.workspace if (later or phase != "forward") else self.st.workspace_first
        opt = self.st.master + (self.st.state if later else 0) + extra_opt
        b = {"param": self.st.param, "grad": grad, "optimizer": opt, "activation": act,
             "temporary": temp, "workspace": ws}
        waste = self.st.waste_param + grad_waste + (self.st.waste_optimizer if later else 0)
        self.points.append(Point(phase, self.iteration, b, waste, self.current))


def walk(steps: list[Step], st: Statics, iterations: int = 2) -> list[Point]:
    """All timeline points of `iterations` training iterations."""
    points: list[Point] = []
    total = sum(s.grad for s in steps), sum(s.grad_waste for s in steps)
    output = 0  # what the previous micro-step's output object holds (custom loop)
    for it in range(iterations):
        w = _Walk(st, it)
        if st.generation:  # GRPO: the step's completions, before its first forward
            w.point("generation", st.inputs - st.generation_held, st.generation, 0, 0)
        for micro in range(st.grad_accum):
            acc = total if (micro > 0) else None
            output = _micro_step(w, steps, st, output, acc)
        grad, grad_waste = total
        if st.in_backward:  # the hooks stepped every parameter and freed its grad already
            w.point("optimizer", st.inputs + output + st.loss, 0, 0, 0)
            points += w.points
            continue
        if st.clip_temp:  # clip_grad_norm_: before the step creates the state
            w.point("optimizer", st.inputs + output + st.loss, st.clip_temp,
                    0 if st.master_grads else grad, grad_waste, extra_opt=st.master_grads,
                    state=False)
        # optimizer step (bf16-master: the fp32 master grads replace the grads)
        w.point("optimizer", st.inputs + output + st.loss, st.opt_temp,
                0 if st.master_grads else grad, grad_waste, extra_opt=st.master_grads)
        points += w.points
    return points


def _micro_step(w: _Walk, steps: list[Step], st: Statics, before_out: int,
                acc: tuple[int, int] | None) -> int:
    """Forward + backward of one micro-step; `acc` = (grads, their waste) already live when
    accumulating, else None. Returns what its output object holds (0 for the trainer loop)."""
    act = st.inputs + before_out + (st.loss if before_out else 0)
    for w.current, s in enumerate(steps):  # forward
        early = s.acts.fwd_after_top if not s.ckpt and s.on_path else 0
        w.point("forward", act + s.kept - early, s.acts.fwd_extra, *(acc or (0, 0)))
        act += s.kept
    w.current = -1
    if st.ref_forward:  # the reference's forward, the policy's graph alive
        w.point("forward", act, st.ref_forward, *(acc or (0, 0)))
    act -= sum(s.released_at_forward_end for s in steps)
    output = 0
    if st.custom:  # the new output object keeps its tensors; the previous one dies now
        output = st.logits + sum(s.held_by_output for s in steps)
        act += output - before_out - (st.loss if before_out else 0)
    if st.in_backward:
        _backward_stepping(w, steps, act)
        w.current = -1
        return output
    grad, grad_waste = acc or (0, 0)
    pending = 0  # a tied weight's lm_head grad in autograd's input buffer
    for w.current, s in reversed(list(enumerate(steps))):  # backward
        if acc is None:
            grad += s.grad
            grad_waste += s.grad_waste
        if not s.on_path:
            continue
        recompute = s.acts.recomputed if s.ckpt else 0
        if acc is not None:
            pending += max(s.tie, 0)
            new = s.grad_max
            mlp_grad = rest_grad = grad + pending
        else:
            new = (0, 0)
            mlp_grad, rest_grad = grad - s.grad + s.grad_mlp[0], grad - s.grad + s.grad_mlp[1]
        if recompute and s.acts.recompute_extra:  # its top, the output's grad waiting
            w.point("backward", act + recompute, s.acts.recompute_extra + s.acts.ckpt_saved,
                    grad - s.grad if acc is None else grad + pending, grad_waste)
        if s.acts.bwd_mlp:  # MLP half, then attention half with the MLP's saved freed
            w.point("backward", act + recompute, s.acts.bwd_mlp + new[0], mlp_grad, grad_waste)
            w.point("backward", act + recompute - s.acts.mlp_saved - s.acts.bwd_top_freed,
                    s.acts.bwd_extra + new[1],
                    rest_grad, grad_waste)
        else:  # a weight grad made in the forward is counted once: as the grad (Liger FLCE)
            w.point("backward", act + recompute - s.acts.grad_in_saved,
                    s.acts.bwd_extra + max(new),
                    grad + pending if acc is not None else grad, grad_waste)
        if acc is not None and s.tie < 0:
            pending = 0
        act -= s.kept - s.released_at_forward_end
    w.current = -1
    return output


def _backward_stepping(w: _Walk, steps: list[Step], act: int) -> None:
    """Backward under optimizer-in-backward. Per stage of a layer: its backward transients
    with the grad in flight (the stage's largest), then that parameter's step: autograd runs
    a parameter's AccumulateGrad node (and so its post-accumulate-grad hook) after the node
    that made the grad, which has released its saved tensors by then (the stage's saved
    tensors are gone; the grad flowing on, one hidden-state tensor, is alive) with one
    parameter's step temporaries. Iteration 0 creates the state layer by layer (last layer
    first), later iterations hold all of it. A tied weight's lm_head grad waits in autograd's
    input buffer until the embedding's backward."""
    state = 0  # state created so far in iteration 0 (the `later` flag covers iteration > 0)
    pending = 0
    for w.current, s in reversed(list(enumerate(steps))):
        if not s.on_path:  # no backward runs through it: its params get no grad, no step
            continue
        state += s.state
        before = pending  # the lm_head's own tied grad appears at the end of its backward
        pending += max(s.tie, 0)
        recompute = s.acts.recomputed if s.ckpt else 0
        extra = state if w.iteration == 0 else 0
        flowing = s.acts.ckpt_saved  # the hidden-state grad passed on (decoder/encoder layer)
        after = act - (s.kept - s.released_at_forward_end)
        # a tied lm_head's weight grad is not stepped here: it is the `pending` buffer
        tied_head = s.tie > 0 and sum(s.grad_max) <= s.tie
        stages = ([(s.acts.bwd_mlp, s.grad_max[0], act + recompute,
                    act + recompute - s.acts.mlp_saved),
                   (s.acts.bwd_extra, s.grad_max[1], act + recompute - s.acts.mlp_saved, after)]
                  if s.acts.bwd_mlp else
                  [(s.acts.bwd_extra, 0 if tied_head else max(s.grad_max), act + recompute,
                    after)])
        for transient, grad, during, done in stages:
            w.point("backward", during, transient, grad + before, 0, extra_opt=extra,
                    state=False)
            before = pending
            if grad or s.tie > 0:
                w.point("backward", done, flowing + s.step_temp, grad + pending, 0,
                        extra_opt=extra, state=False)
        if s.tie < 0:
            pending = 0
        act = after


def peak(points: list[Point]) -> Point:
    """The first point with the largest allocated bytes."""
    best = points[0]
    for p in points[1:]:
        if p.allocated > best.allocated:
            best = p
    return best
