"""Which TRL trainer a config JSON is for, read from its own keys (TRL's configs are
TrainingArguments subclasses: the keys beyond those name the trainer and its objective).
"""

from __future__ import annotations


# SFTConfig's own dataset keys (trl/trainer/sft_config.py; not TrainingArguments fields): a
# config JSON that has one is an SFTTrainer's (`trainer="trl"`)
SFT_MARKERS: tuple[str, ...] = ("dataset_text_field", "completion_only_loss",
                                "assistant_only_loss", "dataset_kwargs")


OBJECTIVE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("grpo", ("num_generations", "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization")),
    ("kto", ("desirable_weight", "undesirable_weight")),
    ("rm", ("center_rewards_coefficient",)),
    ("dpo", ("rpo_alpha", "loss_type", "precompute_ref_log_probs")),
    ("orpo", ("beta",)),
)
# DPOConfig / SFTConfig / GRPOConfig all have `loss_type`: only DPO's values name DPO
DPO_LOSS_TYPES = frozenset({"sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair",
                            "sppo_hard", "aot", "aot_pair", "apo_zero", "apo_down",
                            "discopop", "sft"})


def objective_of(args: dict) -> str | None:
    """The objective a TRL config JSON's keys name (`OBJECTIVE_MARKERS`), else None."""
    for objective, keys in OBJECTIVE_MARKERS:
        for key in keys:
            if key not in args:  # a dumped config carries its fields, null ones included
                continue
            if key == "loss_type" and (not isinstance(args[key], (str, list)) or any(
                    v not in DPO_LOSS_TYPES for v in
                    (args[key] if isinstance(args[key], list) else [args[key]]))):
                continue
            if objective == "kto" and "precompute_ref_log_probs" in args:
                return "kto"
            return objective
    return None
