"""What the analytic tier prices: the one rule, kept next to the tier.

`refusal(spec)` is the tier's own refusal (`estimate.setup` raises it) and what every other
reader asks to know whether this tier prices a job: the tier chooser and its advice
(`hybridmem.predict`), the micro-batch search's guide, the hybrid tier's fallback. Torch-free:
it reads the config JSON only, so choosing a tier costs no torch import.
"""

from __future__ import annotations

from hybridmem.errors import SpecError

# Checkpointing policies the closed forms price when adapters are on (`sac.py`: op-level
# checkpointing's every-second-mm count is shifted by the adapters' own mms)
ADAPTER_CKPT_POLICIES: tuple[str, ...] = ("full", "every:N")


def refusal(spec) -> SpecError | None:
    """Why the analytic tier does not price `spec` (the one-line error it raises), or None.

    Each refusal is a job the closed forms do not describe, not bad input: a PEFT method other
    than LoRA/DoRA, a family without closed forms, LoRA or a dtype other than bf16 on the MoE
    families' fused experts, op-level checkpointing with adapters."""
    if spec.train == "peft":
        from hybridmem.adapters import peft_type

        return SpecError("train", "peft",
                         reason=f"{peft_type(spec)} adapters have no closed form here")
    from hybridmem.models.loader import analytic_refusal, is_analytic, model_type_of

    model_type = model_type_of(spec.model)
    if not is_analytic(model_type):
        return analytic_refusal(model_type)
    from hybridmem.families.common.decoder_graph import MOE_TYPES

    if model_type in MOE_TYPES:
        if spec.train != "full":
            return SpecError("train", spec.train, ("full",), reason=f"adapters on {model_type}'s "
                             "fused 3-D experts (PEFT target_parameters) have no closed form here")
        if spec.precision != "bf16":
            # transformers' grouped-mm experts take bf16 (`_grouped_mm`): other dtypes run a
            # fallback whose memory is not priced
            return SpecError("precision", spec.precision, ("bf16",),
                             reason=f"{model_type}'s grouped-mm experts are priced in bf16")
    if spec.grad_ckpt and spec.grad_ckpt_policy == "ops" and spec.train == "lora":
        return SpecError("grad_ckpt_policy", "ops", ADAPTER_CKPT_POLICIES, reason="op-level "
                         "checkpointing with adapters (their mms shift torchtitan's every-second-"
                         "mm count) has no closed form here")
    return None
