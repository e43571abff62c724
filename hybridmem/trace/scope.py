"""What the trace tier prices: the one rule, kept next to the tier.

The trace tier runs transformers' own training step, so it prices any family and PEFT method
that step runs under fake tensors; what it cannot run is found by running it (a one-line
`UnsupportedModelError`). `refusal(spec)` names what is known before running: read by the
tier itself (`trace._validate`) and by the tier chooser and its advice (`hybridmem.predict`).
It reads the config JSON only (the trace package it sits in imports torch).
"""

from __future__ import annotations

from hybridmem.errors import SpecError

# precisions whose parameters are bf16 (`torch_dtype.PARAM_DTYPE`; a test checks the two agree)
BF16_PARAMS: tuple[str, ...] = ("bf16", "bf16-master", "bf16-autocast")


def refusal(spec) -> SpecError | None:
    """Why the trace tier does not price `spec` (the one-line error it raises), or None.

    The MoE families' experts run `torch._grouped_mm`, whose meta kernel takes bf16 inputs only
    (torch/_meta_registrations.py `_meta_grouped_mm_common`: "Expected inputs of BF16 type"):
    the experts' weights must be bf16, which they are under a bf16 precision unless peft's
    `prepare_model_for_kbit_training` casts every unquantised parameter (the 3-D experts are not
    nn.Linear, so not quantised) to fp32. transformers 4.x's experts choose their tokens by
    value (`torch.where`), which no trace can run: refused there, naming the release needed."""
    from hybridmem.families.common.decoder_graph import MOE_TYPES
    from hybridmem.models.loader import model_type_of

    model_type = model_type_of(spec.model)
    if model_type not in MOE_TYPES:
        return None
    from hybridmem.environment import installed
    from hybridmem.trace.compat import transformers_major

    if transformers_major() < 5:  # 4.x: `torch.where(expert_mask[e])` per expert (4.57 modeling_mixtral.py)
        return SpecError("method", "trace", reason=f"{model_type}'s experts on transformers "
                         f"{installed('transformers')} pick tokens by value, which a trace "
                         "cannot run; the trace tier needs transformers>=5.0 for them")
    why = f"{model_type}'s grouped-mm experts run in bf16 only under fake tensors"
    if spec.precision not in BF16_PARAMS:
        return SpecError("precision", spec.precision, BF16_PARAMS, reason=why)
    if spec.quantize != "none" and spec.kbit_prep:
        return SpecError("kbit_prep", True, (False,), reason=f"{why}, and "
                         "prepare_model_for_kbit_training casts them to fp32")
    return None
