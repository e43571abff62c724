"""What a technique module provides; `hybridmem.techniques` finds every module of this package
that does, and the tiers, the harness and the checks call them instead of `if spec.<flag>`.

A technique (a kernel set, a loss replacement, ...) is one module: its spec-level check, the
models it supports, its analytic terms, what it installs in the trace tier's model, how the
harness applies it on a real GPU, and its note. A technique on an axis (`AXIS`, e.g. the loss)
is one choice of that axis: the axis takes one choice at a time, checked once for all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol


@dataclass(frozen=True, slots=True)
class Target:
    """The model a technique patches, as the family records describe it
    (`hybridmem.families.target`): techniques sit below the families and keep no list of them."""

    model_type: str
    patched: str | None
    """The model_type the library's patch is chosen by: the LM's for a VLM patched through its
    LM (Liger's `apply_liger_kernel_to_llava`), else `model_type`."""
    priced: frozenset[str] = frozenset()
    """The techniques (`NAME`) whose patch of this model is priced (`Family.techniques`)."""
    listed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Technique -> the model_types whose records list it (the refusals' valid choices)."""


class Technique(Protocol):
    NAME: str
    """The technique's choice name on its axis (`--loss NAME`), or its own name."""
    AXIS: str | None
    """The axis it is one choice of ("loss"), or None for a technique that combines freely."""
    FLAG: str
    """The spec field that asks for it (`liger`, `chunked_ce`, ...)."""
    OBJECTIVES: tuple[str, ...]
    """The objectives it is priced with; the flag with any other objective is refused unless
    another technique on the same flag prices it (`techniques.objectives_of`)."""

    @staticmethod
    def active(spec) -> bool:
        """Whether the job asks for it (the spec's shorthand fields)."""

    @staticmethod
    def check(spec) -> None:
        """Its spec-level rules (model-free), a one-line SpecError when broken."""

    @staticmethod
    def applies(target: Target) -> bool:
        """Whether it changes this model: False where the library skips the model (it trains
        unchanged), a SpecError where the library patches it with what is not priced."""

    @staticmethod
    def kept_logits(spec, b: int, s: int, vocab: int, e: int) -> list[tuple[int, int]] | None:
        """(numel, bytes per element) of the logits the causal LM's output keeps (a custom
        loop holds them), given the head's batch, length, vocabulary and compute bytes where
        it `applies`; None: the plain (b, s, V) logits."""

    @staticmethod
    def note(spec, model_type: str, applies: bool) -> str | None:
        """The analytic answer's note on it."""

    @staticmethod
    def install(model, spec, target: Target) -> str | None:
        """Patch the trace tier's (or the CPU stand-in's) model instance with its emulated
        kernels; returns the text model type whose RoPE the run patches, if any."""

    @staticmethod
    def apply_real(model, spec) -> None:
        """On CUDA, the library itself as the trainer applies it (ImportError if missing)."""


def adapts_lm_head(spec) -> bool:
    """LoRA or a trainable copy (`modules_to_save`) on lm_head: a fused loss that reads
    `lm_head.weight` itself would bypass it."""
    return spec.lora is not None and ("lm_head" in spec.lora.targets
                                      or "lm_head" in spec.lora.modules_to_save)


# optional hooks, each read through a function of `hybridmem.techniques` (off-axis techniques):
# `graph_spec(spec)` -> the spec the model graph and the batch are built for (`graph_spec`);
# `check_batch(spec, images)` -> its refusals of the batch (`check_batch`; `images`: per sample);
# `batch_inputs(spec, device)` -> tensors it adds to the batch (`batch_inputs`).
# `optimizer(params, build, step)` -> the optimizer that replaces `build(params)` (`optimizer`);
# `checkpointed(model, spec, device)` -> the harness's patch once checkpointing is on
# (`checkpointed`); `checkpoint_kwargs(spec)` -> the checkpoint's kwargs (`checkpoint_kwargs`;
# op-level SAC's policy); `loop_context(model, spec, device)` -> a context each forward runs in, or
# None (`loop_context`).
# An off-axis technique's `note` is the answers' note on it, None for none (`notes`).
# optional: `head_tensors(R, S, H, V, e, stream, param, reference) -> {"saved", "fwd",
# "grad_in_saved": [(numel, bytes)]}`, the analytic tier's lm_head + loss where it replaces them
# (read through `techniques.head_of`)

REQUIRED: tuple[str, ...] = ("NAME", "AXIS", "FLAG", "OBJECTIVES", "active", "check", "applies", "kept_logits",
                             "note", "install", "apply_real")
"""The attributes a module must have to be a technique."""
