"""Cut Cross-Entropy (`--loss cce`, `--cut-cross-entropy`; axolotl `cut_cross_entropy: true`):
the loss from the hidden states and `lm_head.weight` without (N, V) logits. The rules, the
allocations in torch and the real patch are `hybridmem.job.cce`; docs/loss.md.
"""

from __future__ import annotations

from hybridmem.errors import SpecError
from hybridmem.job import cce as rules
from hybridmem.job.precision import POLICIES
from hybridmem.techniques.protocol import adapts_lm_head

NAME = "cce"
AXIS = "loss"
FLAG = "cut_cross_entropy"
OBJECTIVES: tuple[str, ...] = ("sft",)  # priced with the LM loss only


def active(spec) -> bool:
    return bool(spec.cut_cross_entropy)


def check(spec) -> None:
    """LoRA / modules_to_save on lm_head (the patch reads `lm_head.weight` directly); fp32
    weights (`cce_backward_kernel` asserts fp16 / bf16)."""
    if not isinstance(spec.cut_cross_entropy, bool):
        raise SpecError("cut_cross_entropy", spec.cut_cross_entropy, [True, False])
    if not spec.cut_cross_entropy:
        return
    if POLICIES[spec.precision].param_bytes != 2:
        raise SpecError("precision", spec.precision,
                        [p for p, pol in POLICIES.items() if pol.param_bytes == 2],
                        reason="Cut Cross-Entropy's backward needs fp16 / bf16 weights and "
                        "hidden states (cce_backward_kernel asserts it)")
    if adapts_lm_head(spec):
        raise SpecError("cut_cross_entropy", True, [False], reason="CCE reads lm_head.weight "
                        "directly: LoRA / modules_to_save on lm_head is bypassed")


def applies(model_type: str, text_type: str | None) -> bool:
    rules.check_model(model_type, text_type)  # a model the patch does not list: a SpecError
    return True


def kept_logits(spec, b: int, s: int, vocab: int, e: int) -> list[tuple[int, int]] | None:
    return []  # `cce_forward`: no logits


def head_tensors(d: dict, c, need_in: bool, need_w: bool) -> dict[str, list[tuple[int, int]]]:
    """lm_head + loss under Cut Cross-Entropy (`job.cce.head_tensors`, its docstring cites the
    kernels): the head's input (e) and valids, lse, logit_avg saved; no logits; the forward's
    high point is the valids' nonzero output beside its int32 cast; the backward makes e's
    grad, the locks and the vocab ordering, and lm_head's grad when it trains."""
    return rules.head_tensors(d["b"], d["s"], d["h"], d["vocab"], c.e, need_in, need_w)


def note(spec, model_type: str, applies: bool) -> str | None:
    return ("cut_cross_entropy: no logits; lse, logit_avg and the counted tokens' indices "
            "saved, as cut-cross-entropy's kernels allocate (docs/loss.md)")


def install(model, spec, config) -> str | None:
    rules.emulate(model, config)
    return None


def apply_real(model, spec) -> None:
    rules.apply_real(model)
