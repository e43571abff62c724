"""GRPO (TRL `GRPOTrainer`): generation of `max_completion_length` tokens with a KV cache under
`torch.inference_mode()`, then the reference's log-probs when `beta > 0`, then the policy
forward and backward on prompt + completion (`step.py`). `micro_batch` counts completions as
TRL's `per_device_train_batch_size` does (grpo_config.py: the effective batch must be divisible
by `num_generations`); the generation batch is `micro_batch x grad_accum` sequences
(`steps_per_generation` defaults to `gradient_accumulation_steps`)."""

from __future__ import annotations

from math import gcd

from hybridmem.errors import SpecError
from hybridmem.objectives import rules

NAME = "grpo"
ORDER = 5
HEAD = "logps_kept"
# grpo_config.py: beta 0.0, "the reference model is not loaded"
DEFAULT_BETA = 0.0
FUSED_OUTPUTS: tuple[str, ...] | None = ("log_probs", "entropy")  # grpo_trainer.py __init__
BATCH_COLUMNS = -1  # a stand-in of ids only: the generation makes the step's
GENERATES = True
# trl/trainer/grpo_config.py: max_completion_length 256, vllm_gpu_memory_utilization 0.3
# (colocate mode)
DEFAULT_COMPLETION = 256
DEFAULT_VLLM_FRACTION = 0.3


def beta_of(spec) -> float:
    return rules.beta(spec, DEFAULT_BETA)


def reads_reference(spec) -> bool:
    """grpo_trainer.py: `if self.beta == 0.0: self.ref_model = None`."""
    return beta_of(spec) != 0


def completion_length(spec) -> int:
    """Generated tokens per sequence (TRL's default when the field is open)."""
    return spec.max_completion_length or DEFAULT_COMPLETION


def prompt_length(spec) -> int:
    """The sequence is prompt + completion: `seq_len - completion`."""
    return spec.seq_len - completion_length(spec)


def old_logps(spec) -> bool:
    """Whether the generation phase computes the old policy's log-probs (grpo_trainer.py
    `_generate_and_score_completions`: when `gradient_accumulation_steps % (steps_per_generation
    x num_iterations)` is not 0; steps_per_generation defaults to the accumulation steps, so
    exactly when `num_iterations > 1`)."""
    return spec.num_iterations > 1


def micro_batch_step(spec) -> int:
    """The generation batch (micro_batch x grad_accum x world_size) must split into whole
    groups of `num_generations` (grpo_trainer.py __init__)."""
    n = spec.num_generations
    return n // gcd(n, spec.grad_accum * spec.parallel.world_size)


def at_micro_batch(spec, batch: int):
    """`num_generations` shrinks to a group size that still divides the generation batch; the
    group size changes no tensor of the step."""
    total = batch * spec.grad_accum * spec.parallel.world_size
    return spec.with_(micro_batch=batch, num_generations=gcd(spec.num_generations, total))


def check(spec) -> None:
    ref, beta = spec.ref_model, beta_of(spec)
    if ref not in (None, "none") and beta == 0:
        raise SpecError("ref_model", ref, ("none",), reason="GRPO loads no reference model at "
                        "beta 0 (TRL's default): give --beta > 0")
    if beta != 0:
        rules.needs_reference(spec, NAME)
    rules.adapter_reference(spec)
    if ref == "precomputed":
        raise SpecError("ref_model", ref, ("separate", "adapter"),
                        reason="GRPO's completions are generated each step: no precomputed "
                        "reference log-probs")
    batch = spec.micro_batch * spec.grad_accum * spec.parallel.world_size
    if batch % spec.num_generations:
        # grpo_trainer.py __init__: the generation batch must split into whole groups
        raise SpecError("num_generations", spec.num_generations,
                        reason=f"must divide micro_batch x grad_accum x world_size = {batch} "
                        "(TRL counts the batch in completions)")
    if completion_length(spec) >= spec.seq_len:
        raise SpecError("max_completion_length", completion_length(spec),
                        reason=f"must leave a prompt inside seq_len={spec.seq_len} "
                        "(the sequence is prompt + completion)")
    if spec.max_prompt_length is not None \
            and spec.max_prompt_length + completion_length(spec) != spec.seq_len:
        raise SpecError("max_prompt_length", spec.max_prompt_length,
                        reason=f"GRPO's sequence is max_prompt_length + max_completion_length "
                        f"= {spec.max_prompt_length + completion_length(spec)}, not seq_len="
                        f"{spec.seq_len} (give the sum as --seq-len)")
    rules.trl_step(spec, NAME)


def note(spec) -> str:
    text = (f"; generation of {completion_length(spec)} tokens for "
            f"{spec.micro_batch * spec.grad_accum} sequences (micro_batch x grad_accum, "
            "TRL's generation batch) with a KV cache")
    if spec.vllm_gpu_memory_utilization:
        text += (f"; vLLM colocated reserves {spec.vllm_gpu_memory_utilization:g} of the "
                 "GPU's memory (gpu_memory_utilization, a stated rule: vLLM pre-allocates "
                 "that fraction for its weights and KV cache)")
    return text
