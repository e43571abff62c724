"""The LoRA target rule: what "all LLM linear layers" means on a given model.

A job rule, not an adapter builder: the model graph (`models.build`), the trace tier
(`trace.model.lora_targets_for`) and the harness read the same answer off their own model.
"""

from __future__ import annotations

import dataclasses

from hybridmem.job.spec import DEFAULT_LORA_TARGETS, LoraSpec


def default_targets(lora: LoraSpec, linear_names) -> LoraSpec:
    """`lora` with the targets the default means on a model whose language-model linears
    (lm_head excluded) are `linear_names`: "all LLM linear layers" (`--lora-targets` help;
    PEFT's `all-linear`), i.e. the family's own names (Phi-3's `qkv_proj`, GPT-2's `c_attn`).
    Explicit targets stay as given. The model graph (`models.build`) and the trace tier
    (`trace.model.lora_targets_for`) read their names off their own model and call this."""
    if lora.targets != DEFAULT_LORA_TARGETS or not linear_names:
        return lora
    return dataclasses.replace(lora, targets=tuple(linear_names))
