"""The rules the objective plug-ins share (torch-free): the reference-model choices, the field
checks every objective runs, the reference rules each applies with its own traits, and the
note / summary / vLLM reservation the answers carry.

A helper, not an objective: it names none, and reads an objective's traits only as arguments
(`hybridmem.objectives` passes the job's plug-in).
"""

from __future__ import annotations

from hybridmem.errors import SpecError

REF_MODELS: tuple[str, ...] = ("separate", "adapter", "precomputed", "none")
TRAINERS: tuple[str, ...] = ("transformers", "trl")
"""Who runs the `sft` step: transformers' `Trainer` or TRL's `SFTTrainer` (`trainer` field)."""
ADAPTED: tuple[str, ...] = ("lora", "peft")
"""The `train` choices with PEFT adapters: TRL's reference is then the policy with its
adapters disabled (`adapter`)."""


def beta(spec, default: float) -> float:
    """The loss's beta: the field, else the trainer's `default`."""
    return spec.beta if spec.beta is not None else default


def reference_of(spec, reads: bool) -> str:
    """Where the reference log-probs come from, TRL's default when the field is open: a loss
    that `reads` them with PEFT adapters -> `adapter` (the trainers pass ref_model=None and run
    the policy under peft's `disable_adapter()`: dpo_trainer.py `null_ref_context`), without ->
    `separate` (`create_reference_model`: a frozen deep copy in the policy's dtype); a loss
    that reads none -> `none`."""
    if spec.ref_model is not None:
        return spec.ref_model
    if not reads:
        return "none"
    return "adapter" if spec.train in ADAPTED else "separate"


def check_number(name: str, value: object, low: float, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low \
            or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise SpecError(name, value, reason=f"must be a number {bound}")


def check_fields(spec) -> None:
    """The objective fields' own types and ranges, whatever the objective."""
    if spec.ref_model is not None and spec.ref_model not in REF_MODELS:
        raise SpecError("ref_model", spec.ref_model, REF_MODELS)
    if spec.beta is not None:
        check_number("beta", spec.beta, 0)
    for name in ("num_generations", "max_prompt_length", "max_completion_length"):
        value = getattr(spec, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value <= 0):
            raise SpecError(name, value, reason="must be a positive integer")
    check_number("vllm_gpu_memory_utilization", spec.vllm_gpu_memory_utilization, 0, 1)


def no_reference(spec, name: str) -> None:
    """An objective whose trainer has no reference model (ORPO, RM)."""
    if spec.ref_model not in (None, "none"):
        raise SpecError("ref_model", spec.ref_model, ("none",),
                        reason=f"{name} has no reference model")


def needs_reference(spec, name: str) -> None:
    """An objective whose loss reads reference log-probs: not `none`."""
    if spec.ref_model == "none":
        raise SpecError("ref_model", spec.ref_model, ("separate", "adapter", "precomputed"),
                        reason=f"{name} reads reference log-probs")


def adapter_reference(spec) -> None:
    """The adapter-disabled reference exists only with PEFT adapters."""
    if spec.ref_model == "adapter" and spec.train not in ADAPTED:
        raise SpecError("ref_model", spec.ref_model, ("separate", "precomputed"),
                        reason="the adapter-disabled reference needs --train lora or peft")


def no_vllm(spec) -> None:
    """vLLM generates completions: only an objective that generates (GRPO) colocates it."""
    if spec.vllm_gpu_memory_utilization:
        raise SpecError("vllm_gpu_memory_utilization", spec.vllm_gpu_memory_utilization,
                        reason="vLLM generates for GRPO only")


def trl_step(spec, name: str) -> None:
    """What a TRL trainer's step is priced with: padded batches and the Trainer loop."""
    if spec.packing:
        raise SpecError("packing", True, [False], reason=f"padding-free batches are priced for "
                        f"sft only, not objective={name!r}")
    if spec.loop != "trainer":
        raise SpecError("loop", spec.loop, ["trainer"], reason=f"objective={name!r} is priced as "
                        "its TRL trainer's step")


REFERENCE_WORDS: dict[str, str] = {
    "separate": "a frozen copy of the model in its dtype",
    "adapter": "the policy under peft's disable_adapter()",
    "precomputed": "precomputed log-probs (no reference forward in the step)",
    "none": "none"}


def note(spec, name: str, rows: int, ref: str) -> str:
    """The words every objective beyond SFT starts its note with."""
    return (f"objective {name}: {rows} sequences of {spec.seq_len} tokens per policy forward; "
            f"reference: {REFERENCE_WORDS[ref]}")


def worst_case(spec, prompt: bool = True) -> str:
    """The words a preference objective's note adds: TRL's collators pad each batch to its
    longest sequence after truncating prompts to `max_prompt_length` and the sequences to
    `max_length` (trl/trainer/dpo_trainer.py, kto_trainer.py `_tokenize`; the reward and ORPO
    collators pad the same way), so every sequence is priced at the cap `seq_len`, the
    prompt's positions as scored completion tokens (the largest per-token outputs; `prompt`:
    the objective has one) and the batch as padded (its attention mask reaching every layer's
    SDPA)."""
    cap = (f"truncated to max_prompt_length={spec.max_prompt_length}"
           if spec.max_prompt_length else "at its longest")
    scored = f", the prompt ({cap}) counted as scored completion tokens" if prompt else ""
    return (f"; priced at the worst case: every sequence {spec.seq_len} tokens (max_length, "
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


def summary(spec, ref: str, reference: int, generation: int, generation_peak: int,
            vllm: int) -> dict:
    """The `objective` object of `--json` (docs/objectives.md): the objective, where the
    reference comes from (`ref`), the bytes of the reference model (its copy and what its
    forward holds) and of the generation (KV cache, sampling) live at the step's peak, the
    generation phase's own allocated peak, and vLLM's colocated reservation."""
    return {"objective": spec.objective, "ref_model": ref,
            "reference": reference, "generation": generation,
            "generation_peak_bytes": generation_peak, "vllm_bytes": vllm}
