"""KTO (TRL `KTOTrainer`): micro_batch completions with a reference, plus the KL batch (the same
number of mismatched prompt/completion pairs) through the policy and the reference, both under
`torch.no_grad()` (kto_trainer.py `forward`: `with torch.no_grad(): KL_logits`; `step.py`)."""

from __future__ import annotations

from hybridmem.objectives import rules

NAME = "kto"
ORDER = 3
HEAD = "logps_split"
DEFAULT_BETA = 0.1  # trl/trainer/kto_config.py
# trl 1.16.0 kto_trainer.py: `add_fused_lm_head(..., outputs=(...))`
FUSED_OUTPUTS: tuple[str, ...] | None = ("log_probs", "entropy", "mean_logits")
BATCH_COLUMNS = 2  # the KL batch's ids and labels
PRECOMPUTED_COLUMNS = 3  # chosen's, rejected's, the KL batch's
# its trainer's `loss_is_scaled_for_ga = False` (trl 1.16 trl/trainer/kto_trainer.py:550):
# transformers' loop divides the loss at every step (`objectives.loop_divisions`)
UNSCALED_LOSS = True
# prompt_length 0 (the default): `max_prompt_length` only bounds the prompt (TRL truncates
# to it), the worst case


def reads_reference(spec) -> bool:
    return True


def check(spec) -> None:
    rules.needs_reference(spec, NAME)
    rules.adapter_reference(spec)
    rules.no_vllm(spec)
    rules.trl_step(spec, NAME)


def note(spec) -> str:
    return f"; KL batch of {spec.micro_batch} sequences under no_grad" + rules.worst_case(spec)
