"""Training objectives beyond SFT: what each one runs in a step, as the trainers run it.

The rules live here once (torch-free: every `TrainingSpec` checks them); the trace tier runs
them (`hybridmem.objectives.steps`), the analytic tier prices them (`analytic.objectives`).

- `sft`: the language-model loss of transformers' `ForCausalLMLoss` (every other tier's default).
- `dpo` (TRL `DPOTrainer`, trl/trainer/dpo_trainer.py `concatenated_forward` /
  `compute_ref_log_probs`): chosen and rejected in ONE batch of 2 x micro_batch sequences; the
  policy's per-token log-probs (`selective_log_softmax`, trl/trainer/utils.py), then the
  reference's under `torch.no_grad()` while the policy's graph is alive, then the loss.
- `orpo` (TRL `ORPOTrainer`): the concatenated policy forward, no reference; the SFT NLL on the
  chosen half beside the odds-ratio term.
- `kto` (TRL `KTOTrainer`): micro_batch completions with a reference, plus the KL batch (the
  same number of mismatched prompt/completion pairs) through the policy and the reference,
  both under `torch.no_grad()` (kto_trainer.py `forward`: `with torch.no_grad(): KL_logits`).
- `rm` (TRL `RewardTrainer`): an `AutoModelForSequenceClassification` with `num_labels=1` (a
  scalar `score` head, no vocabulary logits), chosen and rejected concatenated.
- `grpo` (TRL `GRPOTrainer`): generation of `max_completion_length` tokens with a KV cache under
  `torch.inference_mode()`, then the reference's log-probs when `beta > 0`, then the policy
  forward and backward on prompt + completion. `micro_batch` counts completions as TRL's
  `per_device_train_batch_size` does (grpo_config.py: the effective batch must be divisible by
  `num_generations`); the generation batch is `micro_batch x grad_accum` sequences
  (`steps_per_generation` defaults to `gradient_accumulation_steps`).
"""

from __future__ import annotations

from hybridmem.errors import SpecError
# re-exported: the rule lives apart so that the technique modules read it without a cycle
from hybridmem.objectives.trl_head import FUSED_HEAD_SINCE, FUSED_OUTPUTS, fused_head, trl_runs  # noqa: F401

OBJECTIVES: tuple[str, ...] = ("sft", "dpo", "orpo", "kto", "rm", "grpo")
REF_MODELS: tuple[str, ...] = ("separate", "adapter", "precomputed", "none")
TRAINERS: tuple[str, ...] = ("transformers", "trl")
"""Who runs the `sft` step: transformers' `Trainer` or TRL's `SFTTrainer` (`trainer` field)."""
WITH_REFERENCE: tuple[str, ...] = ("dpo", "kto", "grpo")
"""Objectives whose loss reads a reference model's log-probs (GRPO only with beta > 0)."""
PADDED: tuple[str, ...] = ("orpo", "rm")
"""Objectives whose batch carries an attention mask whatever the TRL version: their collators
pad chosen and rejected to the longest (trl 1.16 reward_trainer.py `DataCollatorForPreference`,
trl/experimental/orpo `DPODataCollatorWithPadding`); DPO's, KTO's and SFT's do with the
fused head (`fused_head`)."""
CONCATENATED: tuple[str, ...] = ("dpo", "orpo", "rm")
"""Objectives whose batch is chosen + rejected in one forward (2 x micro_batch sequences)."""

# the trainers' config defaults (trl/trainer/dpo_config.py, orpo_config.py, kto_config.py:
# beta 0.1; grpo_config.py: beta 0.0, "the reference model is not loaded")
DEFAULT_BETA: dict[str, float] = {"dpo": 0.1, "orpo": 0.1, "kto": 0.1, "grpo": 0.0}
# trl/trainer/grpo_config.py: num_generations 8, max_completion_length 256,
# vllm_gpu_memory_utilization 0.3 (colocate mode)
DEFAULT_NUM_GENERATIONS = 8
DEFAULT_COMPLETION = 256
DEFAULT_VLLM_FRACTION = 0.3


def beta_of(spec) -> float:
    """The loss's beta: the field, else the trainer's default (0 for SFT / RM)."""
    return spec.beta if spec.beta is not None else DEFAULT_BETA.get(spec.objective, 0.0)


def ref_model_of(spec) -> str:
    """Where the reference log-probs come from, TRL's default when the field is open: DPO / KTO
    with PEFT adapters -> `adapter` (the trainers pass ref_model=None and run the policy under
    peft's `disable_adapter()`: dpo_trainer.py `null_ref_context`), without -> `separate`
    (`create_reference_model`: a frozen deep copy in the policy's dtype); GRPO -> `none` at
    beta 0 (grpo_trainer.py: `if self.beta == 0.0: self.ref_model = None`), else as DPO;
    ORPO, RM, SFT -> `none`."""
    if spec.ref_model is not None:
        return spec.ref_model
    if spec.objective not in WITH_REFERENCE or (spec.objective == "grpo" and beta_of(spec) == 0):
        return "none"
    return "adapter" if spec.train in ("lora", "peft") else "separate"


def old_logps(spec) -> bool:
    """Whether GRPO's generation phase computes the old policy's log-probs (grpo_trainer.py
    `_generate_and_score_completions`: when `gradient_accumulation_steps % (steps_per_generation
    x num_iterations)` is not 0; steps_per_generation defaults to the accumulation steps, so
    exactly when `num_iterations > 1`)."""
    return spec.objective == "grpo" and spec.num_iterations > 1


def completion_length(spec) -> int:
    """GRPO's generated tokens per sequence (TRL's default when the field is open)."""
    return spec.max_completion_length or DEFAULT_COMPLETION


def prompt_length(spec) -> int:
    """Tokens of the prompt: GRPO `seq_len - completion`; 0 for the preference objectives,
    whose `max_prompt_length` only bounds the prompt (TRL truncates to it): the loss mask then
    covers every position, the most the mean-logits metric copies."""
    if spec.objective == "grpo":
        return spec.seq_len - completion_length(spec)
    return 0


def rows(spec) -> int:
    """Sequences one policy forward runs: 2 x micro_batch for the concatenated objectives."""
    return 2 * spec.micro_batch if spec.objective in CONCATENATED else spec.micro_batch


def micro_batch_step(spec) -> int:
    """The micro-batches a job can take are the multiples of this: GRPO's generation batch
    (micro_batch x grad_accum x world_size) must split into whole groups of `num_generations`
    (grpo_trainer.py __init__); 1 for the other objectives."""
    if spec.objective != "grpo":
        return 1
    from math import gcd

    n = spec.num_generations
    return n // gcd(n, spec.grad_accum * spec.parallel.world_size)


def at_micro_batch(spec, batch: int):
    """`spec` at another micro-batch, for a question about memory only (the allocator's
    replays at smaller micro-batches): GRPO's `num_generations` shrinks to a group size that
    still divides the generation batch; the group size changes no tensor of the step."""
    if spec.objective != "grpo":
        return spec.with_(micro_batch=batch)
    from math import gcd

    total = batch * spec.grad_accum * spec.parallel.world_size
    return spec.with_(micro_batch=batch, num_generations=gcd(spec.num_generations, total))


def _number(name: str, value: object, low: float, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low \
            or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise SpecError(name, value, reason=f"must be a number {bound}")


def check(spec) -> None:
    """One-line SpecErrors for the objective fields and the combinations no trainer runs."""
    if spec.objective not in OBJECTIVES:
        raise SpecError("objective", spec.objective, OBJECTIVES)
    if spec.ref_model is not None and spec.ref_model not in REF_MODELS:
        raise SpecError("ref_model", spec.ref_model, REF_MODELS)
    if spec.beta is not None:
        _number("beta", spec.beta, 0)
    for name in ("num_generations", "max_prompt_length", "max_completion_length"):
        value = getattr(spec, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value <= 0):
            raise SpecError(name, value, reason="must be a positive integer")
    _number("vllm_gpu_memory_utilization", spec.vllm_gpu_memory_utilization, 0, 1)
    o = spec.objective
    if o == "sft":
        given = [n for n in ("ref_model", "beta", "max_prompt_length", "max_completion_length")
                 if getattr(spec, n) is not None]
        if given or spec.vllm_gpu_memory_utilization:
            name = given[0] if given else "vllm_gpu_memory_utilization"
            raise SpecError(name, getattr(spec, name), reason="needs an objective beyond sft "
                            f"(--objective {'|'.join(OBJECTIVES[1:])})")
        return
    ref = spec.ref_model
    if ref not in (None, "none") and o in ("orpo", "rm"):
        raise SpecError("ref_model", ref, ("none",), reason=f"{o} has no reference model")
    if o == "grpo" and ref not in (None, "none") and beta_of(spec) == 0:
        raise SpecError("ref_model", ref, ("none",), reason="GRPO loads no reference model at "
                        "beta 0 (TRL's default): give --beta > 0")
    if o in WITH_REFERENCE and ref == "none" and not (o == "grpo" and beta_of(spec) == 0):
        raise SpecError("ref_model", ref, ("separate", "adapter", "precomputed"),
                        reason=f"{o} reads reference log-probs")
    if ref == "adapter" and spec.train not in ("lora", "peft"):
        raise SpecError("ref_model", ref, ("separate", "precomputed"),
                        reason="the adapter-disabled reference needs --train lora or peft")
    if ref == "precomputed" and o == "grpo":
        raise SpecError("ref_model", ref, ("separate", "adapter"),
                        reason="GRPO's completions are generated each step: no precomputed "
                        "reference log-probs")
    if spec.vllm_gpu_memory_utilization and o != "grpo":
        raise SpecError("vllm_gpu_memory_utilization", spec.vllm_gpu_memory_utilization,
                        reason="vLLM generates for GRPO only")
    batch = spec.micro_batch * spec.grad_accum * spec.parallel.world_size
    if o == "grpo" and batch % spec.num_generations:
        # grpo_trainer.py __init__: the generation batch must split into whole groups
        raise SpecError("num_generations", spec.num_generations,
                        reason=f"must divide micro_batch x grad_accum x world_size = {batch} "
                        "(TRL counts the batch in completions)")
    if o == "grpo" and completion_length(spec) >= spec.seq_len:
        raise SpecError("max_completion_length", completion_length(spec),
                        reason=f"must leave a prompt inside seq_len={spec.seq_len} "
                        "(the sequence is prompt + completion)")
    if o == "grpo" and spec.max_prompt_length is not None \
            and spec.max_prompt_length + completion_length(spec) != spec.seq_len:
        raise SpecError("max_prompt_length", spec.max_prompt_length,
                        reason=f"GRPO's sequence is max_prompt_length + max_completion_length "
                        f"= {spec.max_prompt_length + completion_length(spec)}, not seq_len="
                        f"{spec.seq_len} (give the sum as --seq-len)")
    if spec.packing:
        raise SpecError("packing", True, [False], reason=f"padding-free batches are priced for "
                        f"sft only, not objective={o!r}")
    if spec.loop != "trainer":
        raise SpecError("loop", spec.loop, ["trainer"], reason=f"objective={o!r} is priced as "
                        "its TRL trainer's step")
    from hybridmem import techniques

    # a technique flag is priced with the objectives its technique modules declare
    priced = [n for n in ("liger", "cut_cross_entropy", "chunked_ce")
              if o in techniques.objectives_of(n)]
    clashes = [n for n in ("liger", "cut_cross_entropy", "optimizer_in_backward")
               if getattr(spec, n) and n not in priced] + (
        ["chunked_ce"] if spec.chunked_ce and "chunked_ce" not in priced else []) + (
        ["offload_activations"] if spec.offload_activations != "none" else [])
    if clashes:
        raise SpecError(clashes[0], getattr(spec, clashes[0]), reason=f"priced with sft only, "
                        f"not objective={o!r} (its loss replaces the LM loss)")


def check_model(spec, images: int, model_type: str) -> None:
    """Objectives are priced on text batches of the decoder LLM families."""
    if spec.objective != "sft" and images:
        raise SpecError("objective", spec.objective, ["sft"], reason="preference and RL "
                        "objectives are priced on text-only batches (images_per_sample 0)")


def note(spec) -> str | None:
    """What the job runs besides the policy's step, in words (None for SFT)."""
    o = spec.objective
    if o == "sft":
        return None
    ref = ref_model_of(spec)
    where = {"separate": "a frozen copy of the model in its dtype",
             "adapter": "the policy under peft's disable_adapter()",
             "precomputed": "precomputed log-probs (no reference forward in the step)",
             "none": "none"}[ref]
    text = (f"objective {o}: {rows(spec)} sequences of {spec.seq_len} tokens per policy forward; "
            f"reference: {where}")
    if o == "kto":
        text += f"; KL batch of {spec.micro_batch} sequences under no_grad"
    if o in PREFERENCE:
        text += "; " + worst_case(spec)
    if o == "grpo":
        text += (f"; generation of {completion_length(spec)} tokens for "
                 f"{spec.micro_batch * spec.grad_accum} sequences (micro_batch x grad_accum, "
                 "TRL's generation batch) with a KV cache")
        if spec.vllm_gpu_memory_utilization:
            text += (f"; vLLM colocated reserves {spec.vllm_gpu_memory_utilization:g} of the "
                     "GPU's memory (gpu_memory_utilization, a stated rule: vLLM pre-allocates "
                     "that fraction for its weights and KV cache)")
    return text


PREFERENCE: tuple[str, ...] = ("dpo", "orpo", "kto", "rm")
"""Objectives whose sequences come from a dataset's prompt / completion pairs, padded by the
trainer's collator (their sequences are priced at the worst case, `worst_case`)."""


def worst_case(spec) -> str:
    """The answer's words for what a preference job is priced at: TRL's collators pad each
    batch to its longest sequence after truncating prompts to `max_prompt_length` and the
    sequences to `max_length` (trl/trainer/dpo_trainer.py, kto_trainer.py `_tokenize`; the
    reward and ORPO collators pad the same way), so every sequence is priced at the cap
    `seq_len`, the prompt's positions as scored completion tokens (the largest per-token
    outputs) and the batch as padded (its attention mask reaching every layer's SDPA)."""
    prompt = (f"truncated to max_prompt_length={spec.max_prompt_length}"
              if spec.max_prompt_length else "at its longest")
    scored = "" if spec.objective == "rm" else (
        f", the prompt ({prompt}) counted as scored completion tokens")
    return (f"priced at the worst case: every sequence {spec.seq_len} tokens (max_length, "
            f"the collator padding to the longest){scored}, the batch padded (an attention "
            "mask per layer); shorter data uses less")


VLLM_WITHOUT_GPU = ("vLLM colocated: its reservation is a fraction of a GPU's memory; give "
                    "--gpu to include it (left out here)")


def vllm_bytes(spec, gpu_memory_bytes: int | None) -> int:
    """vLLM colocated with the trainer (TRL `vllm_mode="colocate"`): vLLM sizes its whole
    footprint (its weights, activations and the KV cache it pre-allocates to fill the budget)
    as `gpu_memory_utilization` x the GPU's total memory (vLLM docs, EngineArgs
    `gpu_memory_utilization`: "the fraction of GPU memory to be used for the model executor").
    A stated rule, not a trace; 0 without a GPU to take the fraction of."""
    if not spec.vllm_gpu_memory_utilization or gpu_memory_bytes is None:
        return 0
    return int(spec.vllm_gpu_memory_utilization * gpu_memory_bytes)


def summary(spec, reference: int, generation: int, generation_peak: int,
            vllm: int) -> dict:
    """The `objective` object of `--json` (docs/objectives.md): the objective, where the
    reference comes from, the bytes of the reference model (its copy and what its forward
    holds) and of the generation (KV cache, sampling) live at the step's peak, the generation
    phase's own allocated peak, and vLLM's colocated reservation."""
    return {"objective": spec.objective, "ref_model": ref_model_of(spec),
            "reference": reference, "generation": generation,
            "generation_peak_bytes": generation_peak, "vllm_bytes": vllm}
