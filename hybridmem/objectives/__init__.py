"""Training objectives as plug-ins: one folder per objective (SFT, DPO, ORPO, KTO, RM, GRPO)
behind `protocol.Objective`, found by the registry below; the spec's checks, the tiers, the
harness and the answers call them through it instead of comparing `spec.objective` with names.

Each folder's `__init__.py` is torch-free (every `TrainingSpec` and the analytic tier read
it); its `step.py` is the trainer's step in torch, imported only when a trace or the harness
runs it (`step_of`), so the analytic CLI stays torch-free (tests/test_front_door.py). Adding
an objective is its folder (plus its head's closed form and tests): the choices, the checks
and every consumer follow (docs/design.md, "Where a newcomer adds things").
"""

from __future__ import annotations

import pkgutil
from importlib import import_module

from hybridmem.errors import SpecError
from hybridmem.objectives import rules, trl_head
from hybridmem.objectives.protocol import (
    DEFAULTS, DERIVED, HEADS, LM_HEAD, REQUIRED, SCORE, Objective,
)
from hybridmem.objectives.rules import REF_MODELS, TRAINERS  # noqa: F401  (the job's choices)

HELPERS = frozenset({"protocol", "rules", "trl_head", "steps"})
"""Modules here that are not objectives: the protocol, the shared rules, TRL's fused-head
release rule and the torch code the steps share. The registry never imports `steps`."""


def register(module) -> Objective:
    """`module` as a plug-in: it must name its `REQUIRED` traits, its head among `HEADS` (an
    objective's head is never guessed), and none of the `DERIVED`; every trait it leaves out
    is set to SFT's (`DEFAULTS`), `LM_LOSS` and `SCORE_HEAD` from its head."""
    where = f"objective {module.__name__}"
    missing = [n for n in REQUIRED if not hasattr(module, n)]
    if missing:
        raise RuntimeError(f"{where}: no {', '.join(missing)} (objectives.protocol.REQUIRED)")
    if module.HEAD not in HEADS:
        raise RuntimeError(f"{where}: HEAD {module.HEAD!r} is not a head formula "
                           f"(valid: {', '.join(HEADS)})")
    declared = [n for n in DERIVED if hasattr(module, n)]
    if declared:
        raise RuntimeError(f"{where}: {', '.join(declared)} follow from HEAD, not declared")
    for name, value in DEFAULTS.items():
        if not hasattr(module, name):
            setattr(module, name, value)
    module.LM_LOSS = module.HEAD == LM_HEAD
    module.SCORE_HEAD = module.HEAD == SCORE
    return module


def _registry() -> dict[str, Objective]:
    """`NAME` -> plug-in, of every sub-package here (`register`), in `ORDER`."""
    found = [register(import_module(f"{__name__}.{info.name}"))
             for info in pkgutil.iter_modules(__path__)
             if info.ispkg and info.name not in HELPERS]
    return {m.NAME: m for m in sorted(found, key=lambda m: m.ORDER)}


REGISTRY: dict[str, Objective] = _registry()
OBJECTIVES: tuple[str, ...] = tuple(REGISTRY)
"""The `--objective` choices, the LM loss (SFT, the default) first."""


def of(spec) -> Objective:
    """The job's objective plug-in (`check` has made sure it exists)."""
    return REGISTRY[spec.objective]


def lm_loss(spec) -> bool:
    """The job trains on transformers' causal-LM loss (SFT): no objective batch, loss,
    reference or answer lines of its own."""
    return of(spec).LM_LOSS


def beta_of(spec) -> float:
    """The loss's beta: the field, else the trainer's default (0 for SFT / RM)."""
    return rules.beta(spec, of(spec).DEFAULT_BETA)


def ref_model_of(spec) -> str:
    """Where the reference log-probs come from, TRL's default when the field is open
    (`rules.reference_of`): DPO / KTO `adapter` with PEFT adapters, else `separate`; GRPO
    `none` at beta 0 (grpo_trainer.py: `if self.beta == 0.0: self.ref_model = None`), else as
    DPO; ORPO, RM, SFT `none`."""
    return rules.reference_of(spec, of(spec).reads_reference(spec))


def prompt_length(spec) -> int:
    """Prompt tokens the loss masks out: GRPO's `seq_len - completion`; 0 for the others."""
    return of(spec).prompt_length(spec)


def rows(spec) -> int:
    """Sequences one policy forward runs: 2 x micro_batch for the concatenated objectives."""
    return 2 * spec.micro_batch if of(spec).CONCATENATED else spec.micro_batch


def padded(spec) -> bool:
    """The objective's collator pads to the longest whatever the TRL version (ORPO, RM)."""
    return of(spec).PADDED


def micro_batch_step(spec) -> int:
    """The micro-batches a job can take are the multiples of this (GRPO's whole groups of
    `num_generations`); 1 for the other objectives."""
    return of(spec).micro_batch_step(spec)


def at_micro_batch(spec, batch: int):
    """`spec` at another micro-batch, for a question about memory only (the allocator's
    replays at smaller micro-batches; GRPO's group shrinks to one that still divides it)."""
    return of(spec).at_micro_batch(spec, batch)


def trl_runs(spec) -> bool:
    """Whether a TRL trainer runs the step: every objective but the LM loss, and that one
    under `trainer="trl"` (`SFTTrainer`)."""
    return not lm_loss(spec) or spec.trainer == "trl"


def fused_head(spec, trl_version: str | None) -> bool:
    """Whether the step's log-probs go through TRL's fused, chunked LM head: a TRL trainer
    with one (`FUSED_OUTPUTS`) on `trl_version` (the installed TRL; None: not installed, the
    older full-logits step is priced; docs/objectives.md, "TRL's fused head")."""
    return (of(spec).FUSED_OUTPUTS is not None and trl_runs(spec)
            and trl_head.has_fused_head(trl_version))


def loop_divisions(spec) -> tuple[bool, bool]:
    """The new 0-dim tensors the Trainer loop makes of the step's loss before backward:
    (transformers' `loss / current_gradient_accumulation_steps`, accelerate's
    `Accelerator.backward` `loss / gradient_accumulation_steps`, made whenever the run is not
    DeepSpeed: accelerator.py `backward`). The first is held by `training_step` through the
    backward, the second by `backward`; the loss they divide dies with its last name.

    transformers' `training_step` (trainer.py 5.24: `if not loss_is_scaled_for_ga`) divides at
    every step, accumulation 1 too, the loss of a TRL trainer whose `loss_is_scaled_for_ga` is
    False (the plug-in's `UNSCALED_LOSS`: DPO, KTO, RM, ORPO); GRPOTrainer sets it
    True and SFTTrainer's is scaled by `num_items_in_batch`. Priced for the TRL trainers;
    transformers' own `Trainer` step keeps the division at accumulation > 1 only, without
    accelerate's (one 512-byte block, docs/objectives.md)."""
    if not trl_runs(spec):
        return spec.grad_accum > 1, False
    return of(spec).UNSCALED_LOSS, True


def check(spec) -> None:
    """One-line SpecErrors for the objective fields and the combinations no trainer runs:
    the shared field checks, then the objective's own."""
    if spec.objective not in REGISTRY:
        raise SpecError("objective", spec.objective, OBJECTIVES)
    rules.check_fields(spec)
    objective = of(spec)
    if objective.LM_LOSS:
        given = [n for n in ("ref_model", "beta", "max_prompt_length", "max_completion_length")
                 if getattr(spec, n) is not None]
        if given or spec.vllm_gpu_memory_utilization:
            name = given[0] if given else "vllm_gpu_memory_utilization"
            others = [n for n, o in REGISTRY.items() if not o.LM_LOSS]
            raise SpecError(name, getattr(spec, name), reason=f"needs an objective beyond "
                            f"{spec.objective} (--objective {'|'.join(others)})")
    objective.check(spec)


def check_model(spec, images: int, model_type: str) -> None:
    """Objectives beyond the LM loss are priced on text batches of the decoder LLM families."""
    if not lm_loss(spec) and images:
        raise SpecError("objective", spec.objective,
                        [n for n, o in REGISTRY.items() if o.LM_LOSS],
                        reason="preference and RL objectives are priced on text-only batches "
                        "(images_per_sample 0)")


def note(spec) -> str | None:
    """What the job runs besides the policy's step, in words (None for the LM loss)."""
    objective = of(spec)
    if objective.LM_LOSS:
        return None
    return rules.note(spec, objective.NAME, rows(spec), ref_model_of(spec)) + objective.note(spec)


def summary(spec, reference: int, generation: int, generation_peak: int, vllm: int) -> dict:
    """The `objective` object of `--json` (`rules.summary`)."""
    return rules.summary(spec, ref_model_of(spec), reference, generation, generation_peak, vllm)


# ---------------------------------------------------------------- the step (torch)

def step_of(spec):
    """The objective's `step.py` (torch: imported only here, when a step runs)."""
    return import_module(f"{__name__}.{spec.objective}.step")


def batch(spec, device=None, fused: bool = False) -> dict:
    """The trainer's collated batch (`fused`: its collator at a TRL with the fused head)."""
    return step_of(spec).batch(spec, device, fused)


def collate(spec, sft_batch: dict) -> dict:
    """The LM loss's batch as TRL's collator passes it under its fused head."""
    return step_of(spec).collate(sft_batch)


def loss(job, spec, micro: int = 0):
    """The objective's loss of one micro-step (the runner's `model(**batch).loss`)."""
    return step_of(spec).loss(job, spec, micro)


def prepare(job, spec, every_step: bool = False, autocast=None) -> None:
    """The generation phase of a step before its first micro-step (`GENERATES`); nothing for
    the other objectives. `every_step`: the full sampling loop (the harness measures it);
    `autocast`: the loss's autocast context (trl >= 1.15 runs each log-prob forward in it)."""
    if of(spec).GENERATES:
        step_of(spec).prepare(job, spec, every_step, autocast)
