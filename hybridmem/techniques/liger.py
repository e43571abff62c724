"""Liger kernels (`--loss liger`, `--liger`; TrainingArguments `use_liger_kernel`): fused linear
cross-entropy (no logits), RMSNorm, SwiGLU, RoPE, as liger-kernel 0.8.5 allocates them. The
rules and emulated kernels are `hybridmem.job.loss` (which models, the default kernel set) and
`hybridmem.job.liger` (the kernels in torch, the real patch); docs/loss.md.
"""

from __future__ import annotations

from hybridmem.errors import SpecError
from hybridmem.job import loss as rules
from hybridmem.techniques.protocol import adapts_lm_head

INT64, FP32 = 8, 4

NAME = "liger"
AXIS = "loss"
FLAG = "liger"
OBJECTIVES: tuple[str, ...] = ("sft",)  # priced with the LM loss only


def active(spec) -> bool:
    return bool(spec.liger)


def check(spec) -> None:
    """LoRA or a trainable copy on lm_head: Liger's FLCE reads `lm_head.weight` directly
    (liger_kernel/transformers/model/llama.py `lce_maybe_trainable_lm_head`), so an adapter
    there would be bypassed."""
    if not isinstance(spec.liger, bool):
        raise SpecError("liger", spec.liger, [True, False])
    if spec.liger and adapts_lm_head(spec):
        raise SpecError("liger", True, [False], reason="Liger's fused loss reads "
                        "lm_head.weight directly: LoRA / modules_to_save on lm_head is bypassed")


def applies(model_type: str, text_type: str | None) -> bool:
    return rules.liger_text_type(model_type, text_type) is not None


def kept_logits(spec, b: int, s: int, vocab: int, e: int) -> list[tuple[int, int]] | None:
    return []  # `lce_forward`: no logits (where Liger patches the model at all: `applies`)


def head_tensors(d: dict, c, need_in: bool, need_w: bool) -> dict[str, list[tuple[int, int]]]:
    """lm_head + loss under Liger (`lce_forward` -> `LigerForCausalLMLoss` ->
    `LigerFusedLinearCrossEntropyFunction`; the rules are `hybridmem.job.liger`'s docstring),
    as (numel, bytes) for the analytic tier (`families.decoders.acts.technique_head`).

    Saved: grad_input (B x H, the input's = the stream dtype) and, when both the input and the
    weight need grads, grad_weight (V x H, the weight's dtype; it becomes the weight's .grad at
    backward: `grad_in_saved`). Forward transients: the final norm's output (read only here),
    the padded and shifted labels (int64), loss_1d (fp32), the target mask and its count, then
    per chunk (`flce_chunk_size`, the first is the largest): under autocast the cached bf16
    copy of a trainable weight (`grad_logits @ weight`), the input chunk's cast, the
    transposed weight's cast (a view: not cached) and the chunk's logits; without autocast one
    persistent (chunk x V) logits buffer, and in fp32 the `mm(grad_logits.t(), input)` weight
    product. Backward: a 0-dim tensor (`torch.tensor(1.0)` for the comparison)."""
    b, s, h, V = d["b"], d["s"], d["h"], d["vocab"]
    B = b * s
    rows = rules.flce_chunks(B, h, V)[0]
    grad_w = [(V * h, c.param)] if need_in and need_w else []
    fwd = [(B * h, c.stream), (b * (s + 1), INT64), (B, INT64), (B, FP32), (B, 1), (1, INT64)]
    if c.amp:
        if need_w:
            fwd.append((V * h, 2))                      # autocast cache of the weight cast
        fwd += [(rows * h, 2), (V * h, 2), (rows * V, 2)]
    else:
        fwd.append((rows * V, c.e))                     # logits_storage
        if grad_w and c.e == FP32:
            fwd.append((V * h, FP32))                   # legacy dW product
    return {"saved": [(B * h, c.stream), *grad_w], "fwd": fwd, "bwd": [(1, FP32)],
            "grad_in_saved": grad_w}


def note(spec, model_type: str, applies: bool) -> str | None:
    if not applies:
        return rules.liger_note(model_type)
    from hybridmem.techniques import _trl_head

    if _trl_head(spec):
        return ("liger: RMSNorm, SwiGLU, RoPE as liger-kernel 0.8.5's kernels allocate; the head "
                "is TRL's own fused LM head (its trainers turn Liger's fused linear "
                "cross-entropy off under use_liger_kernel; docs/loss.md)")
    return ("liger: fused linear cross-entropy (no logits; grad_input and grad_weight made in "
            "the forward), RMSNorm, SwiGLU, RoPE as liger-kernel 0.8.5's kernels allocate "
            "(docs/loss.md); RMSNorm's (sm_count x H) dW partials are not counted")


def install(model, spec, config) -> str | None:
    from hybridmem.job import liger
    from hybridmem.techniques import _trl_head

    if spec.objective != "sft" and _trl_head(spec):
        raise SpecError("liger", True, [False], reason=f"the trace tier does not run Liger's "
                        f"layer kernels beside TRL's fused head ({spec.objective}): use "
                        "--method analytic")

    text_cfg = getattr(config, "text_config", None)
    text = rules.liger_text_type(config.model_type, getattr(text_cfg, "model_type", None))
    if text is not None:
        liger.patch_instance(model)
    return text


def apply_real(model, spec) -> None:
    from hybridmem.job import liger

    liger.apply_real(model)
