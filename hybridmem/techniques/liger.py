"""Liger kernels (`--loss liger`, `--liger`; TrainingArguments `use_liger_kernel`): fused linear
cross-entropy (no logits), RMSNorm, SwiGLU, RoPE, as liger-kernel 0.8.5 allocates them. The
rules and emulated kernels are `hybridmem.job.loss` (which models, the default kernel set) and
`hybridmem.job.liger` (the kernels in torch, the real patch); docs/loss.md.
"""

from __future__ import annotations

from hybridmem.errors import SpecError
from hybridmem.job import loss as rules

NAME = "liger"
AXIS = "loss"


def active(spec) -> bool:
    return bool(spec.liger)


def check(spec) -> None:
    """LoRA or a trainable copy on lm_head: Liger's FLCE reads `lm_head.weight` directly
    (liger_kernel/transformers/model/llama.py `lce_maybe_trainable_lm_head`), so an adapter
    there would be bypassed."""
    if not isinstance(spec.liger, bool):
        raise SpecError("liger", spec.liger, [True, False])
    if spec.liger and spec.lora is not None and (
            "lm_head" in spec.lora.targets or "lm_head" in spec.lora.modules_to_save):
        raise SpecError("liger", True, [False], reason="Liger's fused loss reads "
                        "lm_head.weight directly: LoRA / modules_to_save on lm_head is bypassed")


def applies(model_type: str, text_type: str | None) -> bool:
    return rules.liger_text_type(model_type, text_type) is not None


def kept_logits(spec, b: int, s: int, vocab: int, e: int) -> list[tuple[int, int]] | None:
    return []  # `lce_forward`: no logits (where Liger patches the model at all: `applies`)


def note(spec, model_type: str, applies: bool) -> str | None:
    if not applies:
        return rules.liger_note(model_type)
    return ("liger: fused linear cross-entropy (no logits; grad_input and grad_weight made in "
            "the forward), RMSNorm, SwiGLU, RoPE as liger-kernel 0.8.5's kernels allocate "
            "(docs/loss.md); RMSNorm's (sm_count x H) dW partials are not counted")


def install(model, spec, config) -> str | None:
    from hybridmem.job import liger

    text_cfg = getattr(config, "text_config", None)
    text = rules.liger_text_type(config.model_type, getattr(text_cfg, "model_type", None))
    if text is not None:
        liger.patch_instance(model)
    return text


def apply_real(model, spec) -> None:
    from hybridmem.job import liger

    liger.apply_real(model)
