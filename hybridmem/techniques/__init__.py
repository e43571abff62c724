"""Techniques as plug-ins: one module per technique behind `protocol.Technique`, found by the
registry below; the tiers, the harness and the spec's checks call them through it.

The loss replacements are one axis, `loss` (`--loss none|liger|chunked-ce|cce`): a job takes
one choice at a time, checked once here (the old flags `--liger`, `--chunked-ce N`,
`--cut-cross-entropy` are shorthands that fold onto it). Adding a technique is its module here
(plus its rules and tests); the choices, the checks and every consumer follow.
"""

from __future__ import annotations

import pkgutil
from importlib import import_module

from hybridmem.errors import SpecError
from hybridmem.techniques.protocol import REQUIRED, Target, Technique


HELPERS = frozenset({"protocol", "kernels", "liger_kernels", "offload_hooks"})
"""Modules here that are not techniques: the protocol, shared sizing rules and the torch code
the techniques call (Liger's kernels, the offload hooks). The registry never imports them, so
the analytic CLI stays torch-free (tests/test_front_door.py)."""


def _registry() -> dict[str, Technique]:
    """`NAME` -> module, of every module here that provides the protocol, by name."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name in HELPERS:
            continue
        module = import_module(f"{__name__}.{info.name}")
        if all(hasattr(module, name) for name in REQUIRED):
            found[module.NAME] = module
    return dict(sorted(found.items()))


TECHNIQUES: dict[str, Technique] = _registry()
LOSS: dict[str, Technique] = {n: m for n, m in TECHNIQUES.items() if m.AXIS == "loss"}
"""The loss replacements, by `--loss` choice."""
NO_LOSS = "none"
"""transformers' own `ForCausalLMLoss` over the (b, s, V) logits."""
LOSS_CHOICES: tuple[str, ...] = (NO_LOSS, *LOSS)
SHORTHANDS: dict[str, str] = {"liger": "--liger", "chunked-ce": "--chunked-ce",
                              "cce": "--cut-cross-entropy"}
"""The flag each loss choice had before the axis (still accepted, folded onto it)."""


def fold_loss(loss: str | None, liger: bool, chunked_ce: int, cut_cross_entropy: bool) -> dict:
    """The shorthand fields `--loss CHOICE` sets (as the spec stores the axis), checked
    against the shorthands given beside it; {} when `loss` is None."""
    if loss is None:
        return {}
    if loss not in LOSS_CHOICES:
        raise SpecError("loss", loss, LOSS_CHOICES)
    given = {"liger": liger is True, "chunked-ce": bool(chunked_ce) and chunked_ce is not True,
             "cce": cut_cross_entropy is True}
    other = [n for n, on in given.items() if on and n != loss]
    if other:
        raise SpecError("loss", loss, LOSS_CHOICES, reason=f"{SHORTHANDS[other[0]]} says "
                        f"loss={other[0]!r}; give one loss replacement")
    if loss == "liger":
        return {"liger": True}
    if loss == "cce":
        return {"cut_cross_entropy": True}
    if loss == "chunked-ce":
        return {"chunked_ce": chunked_ce or LOSS["chunked-ce"].DEFAULT_CHUNKS}
    return {}


def loss_choice(spec) -> str:
    """The job's choice on the loss axis (`check` has made sure there is at most one)."""
    return next((n for n, m in LOSS.items() if m.active(spec)), NO_LOSS)


def loss_of(spec) -> Technique | None:
    """The job's loss replacement, None for transformers' own loss."""
    return LOSS.get(loss_choice(spec))


def check(spec) -> None:
    """Every technique's spec-level rules, and the loss axis: one replacement at a time."""
    for technique in TECHNIQUES.values():
        technique.check(spec)
    on = [n for n, m in LOSS.items() if m.active(spec)]
    if len(on) > 1:
        flags = ", ".join(SHORTHANDS.get(n, n) for n in on)
        raise SpecError("loss", "+".join(on), LOSS_CHOICES,
                        reason=f"{flags} each replace the loss: give one (--loss CHOICE)")


def objectives_of(flag: str) -> set[str]:
    """The objectives some technique on spec field `flag` is priced with."""
    return {o for m in TECHNIQUES.values() if m.FLAG == flag for o in m.OBJECTIVES}


OBJECTIVE_FLAGS: tuple[str, ...] = ("liger", "cut_cross_entropy", "optimizer_in_backward",
                                    "chunked_ce", "offload_activations")
"""The spec fields whose techniques replace or rewire the LM loss's step: each is priced
only with the objectives its technique modules declare (`OBJECTIVES`)."""


def check_objective(spec) -> None:
    """The first technique flag asked for with an objective no technique on that flag is
    priced with (after `objectives.check`, which has made sure the objective exists)."""
    asked = [n for n in OBJECTIVE_FLAGS
             if getattr(spec, n) and getattr(spec, n) != "none"]
    clashes = [n for n in asked if spec.objective not in objectives_of(n)]
    if clashes:
        raise SpecError(clashes[0], getattr(spec, clashes[0]), reason=f"priced with sft only, "
                        f"not objective={spec.objective!r} (its loss replaces the LM loss)")


def head_of(spec, loss: Technique | None = None) -> Technique | None:
    """The technique whose `head_tensors` replace the analytic lm_head + loss: one of its own
    (Liger's preference losses) first, else the job's loss replacement where it changes the
    model (`loss`, the caller's `applies` answer)."""
    own = [m for m in active(spec) if m.AXIS is None and hasattr(m, "head_tensors")]
    if own:
        return own[0]
    if loss is not None and loss.NAME == "liger" and trl_head_runs(spec):
        return None  # TRL's fused head stays: use_liger_kernel applies the layer kernels only
    return loss if loss is not None and hasattr(loss, "head_tensors") else None


def trl_head_runs(spec) -> bool:
    """Whether the installed TRL runs the step through its own fused LM head; its trainers then
    turn Liger's fused linear cross-entropy off (trl 1.16 sft/dpo/kto_trainer.py:
    `liger_kernel_config["fused_linear_cross_entropy"] = False`)."""
    from hybridmem.environment import installed
    from hybridmem.objectives import fused_head

    return fused_head(spec, installed("trl"))


def graph_spec(spec):
    """The spec the model graph and the batch are built for: an asked-for technique's
    (`graph_spec`, e.g. packing's one row), else `spec` itself."""
    for technique in active(spec):
        if hasattr(technique, "graph_spec"):
            return technique.graph_spec(spec)
    return spec


def check_batch(spec, images: int) -> None:
    """Every asked-for technique's refusals of the batch (`images`: image inputs per sample)."""
    for technique in active(spec):
        if hasattr(technique, "check_batch"):
            technique.check_batch(spec, images)


def batch_inputs(spec, device=None) -> dict:
    """The tensors the asked-for techniques add to the batch (packing's `position_ids`)."""
    out: dict = {}
    for technique in active(spec):
        if hasattr(technique, "batch_inputs"):
            out.update(technique.batch_inputs(spec, device))
    return out


def notes(spec) -> tuple[str, ...]:
    """The notes of the asked-for techniques off any axis that do not replace the head (the
    head's and the loss axis's note is the tier's own, `head_of` / `loss_of`)."""
    said = (m.note(spec, None, True) for m in active(spec)
            if m.AXIS is None and not hasattr(m, "head_tensors"))
    return tuple(n for n in said if n is not None)


def optimizer(spec, params: list, build, step=None):
    """The optimizer an asked-for technique builds over `params` in place of `build(params)`
    (optimizer-in-backward's per-parameter hooks; `step(opt)` replaces `opt.step()`), else
    None: the caller builds its own."""
    for technique in active(spec):
        if hasattr(technique, "optimizer"):
            return technique.optimizer(params, build, step)
    return None


def checkpointed(model, spec, device) -> None:
    """The harness's patches of the asked-for techniques once checkpointing is on (activation
    offloading's `ckpt-inputs` port on the CPU stand-in)."""
    for technique in active(spec):
        if hasattr(technique, "checkpointed"):
            technique.checkpointed(model, spec, device)


def checkpoint_kwargs(spec) -> dict | None:
    """The kwargs an asked-for technique gives transformers' checkpointing (op-level SAC's
    `context_fn`), else None: transformers' own non-reentrant default."""
    for technique in active(spec):
        if hasattr(technique, "checkpoint_kwargs"):
            return technique.checkpoint_kwargs(spec)
    return None


def loop_context(model, spec, device):
    """The context each forward runs in (TRL's activation offloading), or None."""
    for technique in active(spec):
        if hasattr(technique, "loop_context"):
            ctx = technique.loop_context(model, spec, device)
            if ctx is not None:
                return ctx
    return None


def active(spec) -> list[Technique]:
    """The techniques the job asks for."""
    return [m for m in TECHNIQUES.values() if m.active(spec)]


def install(model, spec, target: Target) -> str | None:
    """Every asked-for technique's emulated patch on the trace tier's model instance; the text
    model type whose RoPE the run patches (Liger's), if any; `target`: the model as its family
    record says (`hybridmem.families.target`)."""
    patched = None
    for technique in active(spec):
        patched = technique.install(model, spec, target) or patched
    return patched


def apply_real(model, spec) -> None:
    """Every asked-for technique as its library applies it on CUDA (ImportError if missing)."""
    for technique in active(spec):
        technique.apply_real(model, spec)
