"""torchtune's chunked cross-entropy (`--loss chunked-ce --chunked-ce N`, `--chunked-ce N`):
the output projection in N chunks, each upcast to fp32 inside the loss
(`CEWithChunkedOutputLoss`); the rules and the loss in torch are `hybridmem.job.loss`.
"""

from __future__ import annotations

from hybridmem.errors import SpecError
from hybridmem.job import loss as rules

NAME = "chunked-ce"
AXIS = "loss"
FLAG = "chunked_ce"
OBJECTIVES: tuple[str, ...] = ("sft",)  # priced with the LM loss only
DEFAULT_CHUNKS = 8  # torchtune's recipes: `num_output_chunks = 8` (ce_chunked_output_loss.py)


def active(spec) -> bool:
    return bool(spec.chunked_ce)


def check(spec) -> None:
    n = spec.chunked_ce
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise SpecError("chunked_ce", n, reason="must be a non-negative integer (0 = off)")


def applies(model_type: str, text_type: str | None) -> bool:
    return True  # a plain-torch loss on any causal LM's lm_head


def kept_logits(spec, b: int, s: int, vocab: int, e: int) -> list[tuple[int, int]] | None:
    """The output keeps the list of chunks (`job.loss.chunked_loss_forward`)."""
    return [(b * n * vocab, e) for n in rules.torch_chunks(s, spec.chunked_ce)]


def note(spec, model_type: str, applies: bool) -> str | None:
    return (f"chunked_ce: the logits in {spec.chunked_ce} chunks, each upcast to fp32 inside the "
            "loss (torchtune CEWithChunkedOutputLoss)")


def install(model, spec, config) -> str | None:
    rules.apply_chunked_ce(model, spec.chunked_ce)
    return None


def apply_real(model, spec) -> None:
    rules.apply_chunked_ce(model, spec.chunked_ce)
