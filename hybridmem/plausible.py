"""Soft warnings for a job that can be priced but not run: a sequence past the model's context
window, a step no GPU in the catalogue holds.

Why: the tiers price any shape (a 10^9-token sequence answers 3.6 million GiB), and a number
with no word that the job is impossible reads as a plan. These do not refuse the job (the
schema's bounds do that for values no tier can price); they say, before the answer and in
`job["warnings"]`, why the answer is not a plan.
"""

from __future__ import annotations

from hybridmem.gpus import GPUS

GiB = 2**30


def context_window(model: str) -> int | None:
    """The language model's `max_position_embeddings` (a VLM's text_config's), or None."""
    from hybridmem.models.loader import load_config_dict

    try:
        data = load_config_dict(model)[1]
    except Exception:  # the model's own error comes where the model is built
        return None
    for d in (data.get("text_config") or {}, data):
        value = d.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


def warnings(spec, peak_bytes: int | None = None, searched: bool = False) -> list[str]:
    """What makes the job impossible to run as given (empty when nothing does). `searched`:
    the answer already ran the micro-batch search, so the warning does not suggest it."""
    out = []
    window = context_window(spec.model)
    if window is not None and spec.seq_len > window:
        out.append(f"seq_len={spec.seq_len} is past {spec.model}'s context window "
                   f"(max_position_embeddings {window}): positions past it were never trained; "
                   "a longer-context checkpoint (or rope scaling) is what runs this length")
    largest = max(GPUS.values(), key=lambda g: g.memory_bytes)
    if peak_bytes is not None and peak_bytes > largest.memory_bytes:
        out.append(f"micro_batch={spec.micro_batch} x seq_len={spec.seq_len}: the predicted "
                   f"{peak_bytes / GiB:,.0f} GiB per GPU is more than any GPU in the catalogue "
                   f"holds (the largest, {largest.name}: {largest.memory_bytes / GiB:.0f} GiB); "
                   + ("--find-max-batch gives the largest micro-batch that fits one"
                      if spec.micro_batch > 1 and not searched
                      else "the micro-batch search below says what fits" if spec.micro_batch > 1
                      else "a shorter sequence or more GPUs is needed"))
    return out
