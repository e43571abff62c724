"""DPO (TRL `DPOTrainer`, trl/trainer/dpo_trainer.py `concatenated_forward` /
`compute_ref_log_probs`): chosen and rejected in ONE batch of 2 x micro_batch sequences; the
policy's per-token log-probs (`selective_log_softmax`, trl/trainer/utils.py), then the
reference's under `torch.no_grad()` while the policy's graph is alive, then the loss
(`step.py`)."""

from __future__ import annotations

from hybridmem.objectives import rules

NAME = "dpo"
ORDER = 1
HEAD = "logps_mean_logits"
CONCATENATED = True
DEFAULT_BETA = 0.1  # trl/trainer/dpo_config.py
# trl 1.16.0 dpo_trainer.py (without `use_weighting`): `add_fused_lm_head(..., outputs=(...))`
FUSED_OUTPUTS: tuple[str, ...] | None = ("log_probs", "entropy", "mean_logits", "is_top1")
BATCH_COLUMNS = 0  # the loss mask takes the labels' place
PRECOMPUTED_COLUMNS = 2  # chosen's and rejected's
# its trainer's `loss_is_scaled_for_ga = False` (trl 1.16 trl/trainer/dpo_trainer.py:494):
# transformers' loop divides the loss at every step (`objectives.loop_divisions`)
UNSCALED_LOSS = True


def reads_reference(spec) -> bool:
    return True


def prompt_length(spec) -> int:
    """0: `max_prompt_length` only bounds the prompt (TRL truncates to it), so the loss mask
    covers every position, the most the mean-logits metric copies (the worst case)."""
    return 0


def check(spec) -> None:
    rules.needs_reference(spec, NAME)
    rules.adapter_reference(spec)
    rules.no_vllm(spec)
    rules.trl_step(spec, NAME)


def note(spec) -> str:
    return rules.worst_case(spec)
