"""The peak over a timeline of one training step, for the first and a later iteration.

The loop priced is the standard one: `loss = model(**batch).loss; loss.backward();
opt.step(); opt.zero_grad(set_to_none=True)`. So:
- forward: activations accumulate layer by layer (checkpointed layers keep only their input;
  autocast's cached weight copies live until the forward ends);
- backward, last layer first: a layer's grads appear, its saved tensors (recomputed first when
  checkpointed) and its backward transients are live, then its saved tensors are freed;
- optimizer step: all grads + the state, created lazily in the first step (so iteration 0's
  forward/backward run without it) + the step's temporaries; then the grads are freed.
The batch (ids, labels, pixels; no attention mask) lives for the whole iteration. Each point of the timeline
carries its bytes per category, so the breakdown at the peak is exact, not a sum of maxima.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridmem.analytic.activations import Acts


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

    @property
    def kept(self) -> int:
        """Bytes this layer leaves alive after its forward."""
        if not self.on_path:
            # output unused, but the model's output object (`image_outputs`) holds it and
            # its autograd graph until the forward returns
            return self.acts.saved + self.acts.held
        kept = (self.acts.ckpt_saved + self.acts.cache) if self.ckpt else self.acts.saved
        return kept + self.acts.held

    @property
    def released_at_forward_end(self) -> int:
        if not self.on_path:
            return self.acts.saved + self.acts.held
        return (self.acts.cache if self.ckpt else 0) + self.acts.held


@dataclass(frozen=True, slots=True)
class Point:
    phase: str
    iteration: int
    bytes: dict[str, int]
    waste: int = 0
    """Segment rounding of the persistent tensors alive here (a fragmentation lower bound)."""

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


@dataclass
class _Walk:
    st: Statics
    iteration: int
    points: list[Point] = field(default_factory=list)

    def point(self, phase: str, act: int, temp: int, grad: int, grad_waste: int,
              extra_opt: int = 0) -> None:
        # the state exists from the first optimizer step on (created lazily inside it)
        later = self.iteration > 0 or phase == "optimizer"
        ws = self.st.workspace if (later or phase != "forward") else self.st.workspace_first
        opt = self.st.master + (self.st.state if later else 0) + extra_opt
        b = {"param": self.st.param, "grad": grad, "optimizer": opt, "activation": act,
             "temporary": temp, "workspace": ws}
        waste = self.st.waste_param + grad_waste + (self.st.waste_optimizer if later else 0)
        self.points.append(Point(phase, self.iteration, b, waste))


def walk(steps: list[Step], st: Statics, iterations: int = 2) -> list[Point]:
    """All timeline points of `iterations` training iterations."""
    points: list[Point] = []
    for it in range(iterations):
        w = _Walk(st, it)
        act = st.inputs
        for s in steps:  # forward
            w.point("forward", act + s.kept, s.acts.fwd_extra, 0, 0)
            act += s.kept
        act -= sum(s.released_at_forward_end for s in steps)
        grad = grad_waste = 0
        for s in reversed(steps):  # backward
            grad += s.grad
            grad_waste += s.grad_waste
            if not s.on_path:
                continue
            recompute = s.acts.saved if s.ckpt else 0
            before = grad - s.grad
            if s.acts.bwd_mlp:  # MLP half, then attention half with the MLP's saved freed
                w.point("backward", act + recompute, s.acts.bwd_mlp, before + s.grad_mlp[0],
                        grad_waste)
                w.point("backward", act + recompute - s.acts.mlp_saved, s.acts.bwd_extra,
                        before + s.grad_mlp[1], grad_waste)
            else:
                w.point("backward", act + recompute, s.acts.bwd_extra, grad, grad_waste)
            act -= s.kept - s.released_at_forward_end
        # optimizer step (bf16-master: the fp32 master grads replace the grads)
        w.point("optimizer", st.inputs, st.opt_temp, 0 if st.master_grads else grad,
                grad_waste, extra_opt=st.master_grads)
        points += w.points
    return points


def peak(points: list[Point]) -> Point:
    """The first point with the largest allocated bytes."""
    best = points[0]
    for p in points[1:]:
        if p.allocated > best.allocated:
            best = p
    return best
