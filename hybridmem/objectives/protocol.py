"""What an objective plug-in provides; `hybridmem.objectives` finds every sub-package here that
does, and the spec's checks, the tiers, the harness and the answers call them through it
instead of comparing `spec.objective` with a name.

An objective is one folder, `objectives/<name>/`:
- `__init__.py` (torch-free: every `TrainingSpec` and the analytic tier read it): its traits
  below, its rules (`check`), the reference it reads, its prompt, its note;
- `step.py` (torch, imported only when a trace or the harness runs the step): the trainer's
  collated batch (`batch`) and its loss of one micro-step (`loss`), op for op as TRL runs
  them, on the helpers of `objectives.steps`.
The analytic tier's closed forms read the same traits (`analytic.objectives`); the head's
tensors under the trainer's loss are the decoder family's (`families.common.objective_acts`).
"""

from __future__ import annotations

from typing import Protocol


class Objective(Protocol):
    NAME: str
    """The `--objective` choice."""
    ORDER: int
    """Its place among the choices (SFT, the default, first)."""
    LM_LOSS: bool
    """transformers' causal-LM loss (SFT): no batch, loss, reference or answer lines of its
    own; TRL runs it only under `trainer="trl"`. Every other objective is a TRL trainer's."""
    CONCATENATED: bool
    """Chosen and rejected in ONE forward: 2 x micro_batch sequences (`objectives.rows`)."""
    PADDED: bool
    """Its collator pads to the longest whatever the TRL version: the batch carries an
    attention mask (the others' do with TRL's fused head)."""
    DEFAULT_BETA: float
    """The trainer config's `beta` (0.0: none, or no reference: GRPO)."""
    FUSED_OUTPUTS: tuple[str, ...] | None
    """The per-token fields its trainer asks TRL's fused LM head for (`add_fused_lm_head`'s
    `outputs=`, trl >= 1.15: `objectives.trl_head`); None: its trainer has no fused head."""
    BATCH_COLUMNS: int
    """(rows x seq) int64 columns its collated batch has beyond SFT's ids and labels (the
    analytic tier's `batch_bytes`; negative: fewer). Its `step.batch` makes them."""
    PRECOMPUTED_COLUMNS: int
    """fp32 columns of one value per sequence a `precomputed` reference adds to the batch
    (TRL `precompute_ref_log_probs`); 0 where no precomputed reference is allowed."""
    GENERATES: bool
    """A generation phase once per optimizer step before its first micro-step (GRPO): its step
    module's `prepare`, the analytic tier's `generation` terms."""
    SCORE_HEAD: bool
    """A sequence classifier: the lm_head replaced by a (1, hidden) `score` (RM)."""

    @staticmethod
    def reads_reference(spec) -> bool:
        """Whether its loss reads a reference's log-probs (`objectives.ref_model_of`)."""

    @staticmethod
    def prompt_length(spec) -> int:
        """Prompt tokens of a sequence the loss masks out (0: every position counts)."""

    @staticmethod
    def check(spec) -> None:
        """Its rules beyond the shared field checks (`rules.check_fields`): one-line
        SpecErrors for the combinations its trainer does not run."""

    @staticmethod
    def note(spec) -> str:
        """Words its answers' note adds after the shared start (`rules.note`); "" for none."""


REQUIRED: tuple[str, ...] = ("NAME", "ORDER", "LM_LOSS", "CONCATENATED", "PADDED", "DEFAULT_BETA",
                             "FUSED_OUTPUTS", "BATCH_COLUMNS",
                             "PRECOMPUTED_COLUMNS", "GENERATES", "SCORE_HEAD", "reads_reference",
                             "prompt_length", "check", "note")
"""The attributes a sub-package must have to be an objective."""

# optional trait: `UNSCALED_LOSS = True` -> its trainer's `loss_is_scaled_for_ga` is False, so
# transformers' loop divides its loss at every step (`objectives.loop_divisions`; default False).
# optional hooks, read through `hybridmem.objectives` (GRPO's):
# `micro_batch_step(spec)` -> the micro-batches it can take are the multiples of this
# (`objectives.micro_batch_step`; default 1); `at_micro_batch(spec, batch)` -> `spec` at another
# micro-batch for a question about memory only (`objectives.at_micro_batch`; default `with_`).
#
# its `step.py` (torch; `objectives.step_of`): `loss(job, spec, micro)` -> the loss of one
# micro-step (the runner's `model(**batch).loss`); `batch(spec, device, fused)` -> the trainer's
# collated batch (not for the LM loss, whose batch is the SFT one); optional `collate(batch)` ->
# the SFT batch as TRL's collator passes it (LM loss under TRL's fused head) and
# `prepare(job, spec, every_step, autocast)` -> the generation phase (`GENERATES`).
