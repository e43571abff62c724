"""What an objective plug-in provides; `hybridmem.objectives` finds every sub-package here that
does, and the spec's checks, the tiers, the harness and the answers call them through it
instead of comparing `spec.objective` with a name.

An objective is one folder, `objectives/<name>/`:
- `__init__.py` (torch-free: every `TrainingSpec` and the analytic tier read it): its `NAME`,
  `ORDER` and `HEAD`, then only the traits below where it differs from `DEFAULTS` (SFT's
  step): its rules (`check`), the reference it reads, its prompt, its note;
- `step.py` (torch, imported only when a trace or the harness runs the step): the trainer's
  collated batch (`batch`) and its loss of one micro-step (`loss`), op for op as TRL runs
  them, on the helpers of `objectives.steps`.
The analytic tier's closed forms read the same traits (`analytic.objectives`); the head's
tensors under the trainer's loss are the decoder family's (`families.common.objective_acts`).
"""

from __future__ import annotations

from typing import Protocol

LM_HEAD = "lm"
SCORE = "score"
HEADS: dict[str, str] = {
    LM_HEAD: "transformers' ForCausalLMLoss on the full logits (the family's `lm_head`)",
    SCORE: "a sequence classifier's (1, hidden) `score`: no vocabulary logits",
    "logps_mean_logits": "per-token log-probs of every row, then each half's mean-logits copy",
    "logps_nll": "per-token log-probs beside the chosen half's NLL (cross_entropy)",
    "logps_split": "per-token log-probs, then the desirable / undesirable rows' index copies",
    "logps_kept": "the last completion + 1 positions' logits only (`logits_to_keep`), their "
                  "`/ temperature` copy's per-token log-probs",
}
"""The head formulas an objective's `HEAD` names; the decoder family prices each
(`families.common.objective_acts.HEADS`, `LM_HEAD` the family's own `lm_head`)."""


class Objective(Protocol):
    NAME: str
    """The `--objective` choice."""
    ORDER: int
    """Its place among the choices (SFT, the default, first)."""
    HEAD: str
    """The head formula its trainer's loss runs on the logits (a key of `HEADS`)."""
    LM_LOSS: bool
    """`HEAD == LM_HEAD`, set by the registry: transformers' causal-LM loss (SFT): no batch,
    loss, reference or answer lines of its own; TRL runs it only under `trainer="trl"`. Every
    other objective is a TRL trainer's."""
    SCORE_HEAD: bool
    """`HEAD == SCORE`, set by the registry: a sequence classifier, the lm_head replaced by a
    (1, hidden) `score` (RM)."""
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
    UNSCALED_LOSS: bool
    """Its trainer's `loss_is_scaled_for_ga` is False, so transformers' loop divides its loss
    at every step (`objectives.loop_divisions`)."""

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

    @staticmethod
    def micro_batch_step(spec) -> int:
        """The micro-batches it can take are the multiples of this
        (`objectives.micro_batch_step`)."""

    @staticmethod
    def at_micro_batch(spec, batch: int):
        """`spec` at another micro-batch for a question about memory only
        (`objectives.at_micro_batch`)."""


REQUIRED: tuple[str, ...] = ("NAME", "ORDER", "HEAD")
"""The attributes a sub-package must have to be an objective; the registry refuses one that
lacks any (a head is never guessed)."""

DERIVED: tuple[str, ...] = ("LM_LOSS", "SCORE_HEAD")
"""Traits the registry sets from `HEAD`; a plug-in does not declare them."""


def _no_rules(spec) -> None:
    return None


DEFAULTS: dict[str, object] = dict(
    CONCATENATED=False, PADDED=False, DEFAULT_BETA=0.0, FUSED_OUTPUTS=None, BATCH_COLUMNS=0,
    PRECOMPUTED_COLUMNS=0, GENERATES=False, UNSCALED_LOSS=False,
    reads_reference=lambda spec: False, prompt_length=lambda spec: 0, check=_no_rules,
    note=lambda spec: "", micro_batch_step=lambda spec: 1,
    at_micro_batch=lambda spec, batch: spec.with_(micro_batch=batch))
"""What a plug-in that leaves a trait out gets: SFT's step (one forward of micro_batch rows,
no reference, no prompt mask, no rules or note of its own, any micro-batch) and no fused head."""

# its `step.py` (torch; `objectives.step_of`): `loss(job, spec, micro)` -> the loss of one
# micro-step (the runner's `model(**batch).loss`); `batch(spec, device, fused)` -> the trainer's
# collated batch (not for the LM loss, whose batch is the SFT one); optional `collate(batch)` ->
# the SFT batch as TRL's collator passes it (LM loss under TRL's fused head) and
# `prepare(job, spec, every_step, autocast)` -> the generation phase (`GENERATES`).
