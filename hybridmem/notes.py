"""Which notes the console shows by default: at most `SHOWN`, the telling ones first.

Each answer carries every note its tier wrote (often ten or more, most about internals: default
overheads, how fragmentation was replayed). By default the console shows the tier that answered
and why, the verdict's caveat, and the job assumptions that change the answer; `--verbose`
prints every note and `--json` keeps them all (`Prediction.notes`). A note's kind is read from
how the tiers word it (the prefixes below); a note no prefix matches is an assumption.
"""

from __future__ import annotations

from hybridmem.prediction import Prediction

SHOWN = 3
"""Notes shown without --verbose: the tier line, then the verdict's caveat, then assumptions."""

TIER, VERDICT, ASSUMPTION, INTERNAL = "tier", "verdict", "assumption", "internal"

PREFIXES: dict[str, tuple[str, ...]] = {
    # what the fit verdict rests on (allocator.reserved.capacity_notes, paged_notes, the
    # learned tier's bound and its trust warnings)
    VERDICT: ("does not fit", "fits only after", "fits only within the error", "paged optimizer state", "P95 upper bound",
              "WARNING", "spec outside the model's training range"),
    # which tier answered, said again by the tier line (`extras["method_reason"]`)
    TIER: ("method:", "hybrid:", "no trained residual model", "residual model",
           "model ", "torch "),
    # how the tier computed, not what the job is
    INTERNAL: ("context", "workspace", "fragmentation", "allocator capacity", "NCCL buffers",
               "trace:", "trace tier ran", "known limitation", "meta backend failed", "GPU:",
               "GPU assumed", "GPU ", "nearest training row", "CUDA version unknown",
               "no model registry", "no model in", "skipped "),
}

FIRST: tuple[str, ...] = ("per rank of", "tokens per sample are image tokens")
"""Assumptions shown before the others: the sharding the figure is per rank of, and how much of
each sample is image tokens (what VLM users most often get wrong)."""
LAST: tuple[str, ...] = ("batch: unpadded",)
"""Assumptions shown after the others: true of every job priced without padding."""


def kind(note: str) -> str:
    """TIER, VERDICT, ASSUMPTION or INTERNAL for one note (`PREFIXES`; VERDICT before TIER, so
    a residual model's bound is a verdict note)."""
    for name in (VERDICT, INTERNAL, TIER):
        if note.startswith(PREFIXES[name]):
            return name
    return ASSUMPTION


def _order(note: str) -> int:
    if any(key in note for key in FIRST):
        return 0
    return 2 if note.startswith(LAST) else 1


def tier_line(pred: Prediction) -> str:
    """The tier that answered and why (`extras["method_reason"]`)."""
    reason = pred.extras.get("method_reason")
    return f"tier: {pred.method}" + (f" ({reason})" if reason else "")


def shown(pred: Prediction, limit: int = SHOWN) -> list[str]:
    """The notes the console prints by default: the tier line, the first verdict caveat (with
    a GPU), then assumptions (`FIRST` ones first) up to `limit` lines in all."""
    out = [tier_line(pred)]
    verdicts = [n for n in pred.notes if kind(n) == VERDICT]
    if verdicts and pred.fits is not None:
        out.append(verdicts[0])
    assumptions = sorted((n for n in pred.notes if kind(n) == ASSUMPTION), key=_order)
    return (out + assumptions)[:limit]


def hidden_count(pred: Prediction, limit: int = SHOWN) -> int:
    """How many of the answer's notes `shown` leaves for --verbose."""
    kept = set(shown(pred, limit))
    return sum(1 for n in pred.notes if n not in kept)
