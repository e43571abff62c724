"""Accuracy of every tier against real-GPU rows, by job group and by figure.

The report: per tier (analytic, trace, hybrid held out), per group (full,
LoRA, DoRA, other PEFT, partial) and per measured figure (reserved, device and allocated peaks, the
allocated bytes right after the optimizer step), the error distribution and the share of
under-predictions (the dangerous side: an under-prediction is an OOM we said would fit).
Errors are signed, (predicted - measured) / measured, so a bias shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from hybridmem.adapters import GROUPS, job_group

MEASURED: dict[str, str] = {"reserved": "peak_reserved_bytes", "device": "peak_device_bytes",
                            "allocated": "peak_allocated_bytes",
                            "after_step": "steady_allocated_bytes"}
"""Figure -> dataset column holding its measurement (absent or null where not measured)."""


def row_groups(rows: pd.DataFrame) -> list[str]:
    """`adapters.job_group` of each row's spec ("unreadable" where the spec cannot be rebuilt)."""
    from hybridmem.errors import SpecError
    from hybridmem.harness.schema import spec_from_row

    out = []
    for row in rows.to_dict("records"):
        try:
            out.append(job_group(spec_from_row(row)))
        except (SpecError, ValueError, KeyError, TypeError):
            out.append("unreadable")
    return out


LENGTH_KINDS: tuple[str, ...] = ("exact", "upper-bound")
"""`seq_len_kind` values (harness/schema.py): every batch is `seq_len` long, or `seq_len` is
only the cap of variable lengths. Upper-bound rows are priced at the cap while their batches
were shorter, so their errors are summarised apart from the exact rows', never pooled."""
UPPER_BOUND_NEEDS = (
    "upper bound: rows whose `seq_len` is only the truncation cap of variable-length samples "
    "(`seq_len_kind`); every tier prices them at the cap. Pricing them as they ran needs each "
    "sample's token count (`hybridmem predict --lengths FILE`), the run's sampler and its "
    "number of steps, which their records do not give; no length is fitted to a measurement.")
"""What the tool would need to price upper-bound rows (shown under every table that has them)."""


def length_kinds(rows: pd.DataFrame) -> list[str]:
    """Each row's `seq_len_kind` ("exact" where the dataset predates the column)."""
    if "seq_len_kind" not in rows:
        return ["exact"] * len(rows)
    return [k if isinstance(k, str) and k else "exact" for k in rows["seq_len_kind"]]


def signed_errors(predicted, measured) -> np.ndarray:
    """(predicted - measured) / measured in %, NaN where either is missing."""
    p = np.asarray(predicted, float)
    m = np.asarray(measured, float)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((m > 0) & np.isfinite(p), (p - m) / m * 100, np.nan)


def summary(err: np.ndarray) -> dict[str, float]:
    """n, median / P95 / max of |error|, median signed error, under-prediction share."""
    e = err[np.isfinite(err)]
    if not len(e):
        return {"n": 0}
    a = np.abs(e)
    return {"n": float(len(e)), "median_ape": float(np.median(a)), "p95_ape": float(np.percentile(a, 95)),
            "max_ape": float(a.max()), "median_signed": float(np.median(e)),
            "within_3pct": float(np.mean(a <= 3.0)), "under_share": float(np.mean(e < 0))}


@dataclass
class Accuracy:
    """Signed errors per row and the summary table."""

    errors: pd.DataFrame
    """One row per (dataset row, tier, figure): group, experiment, measured, predicted, error_pct."""
    table: pd.DataFrame
    """One row per (figure, tier, lengths, group) with `summary`'s columns; group "all" over every
    row of that length kind (`LENGTH_KINDS`: exact and upper-bound rows are never pooled)."""
    notes: list[str] = field(default_factory=list)


def accuracy(rows: pd.DataFrame, predictions: dict[str, pd.DataFrame]) -> Accuracy:
    """Errors of each tier's `predictions` (name -> a frame aligned with `rows`, one column per
    figure as `tier_rows.FIGURES`) against the figures `rows` measured."""
    groups = row_groups(rows)
    kinds = length_kinds(rows)
    label = rows["experiment"] if "experiment" in rows else rows["model_name"]
    long = []
    for figure, column in MEASURED.items():
        if column not in rows or not pd.to_numeric(rows[column], errors="coerce").notna().any():
            continue
        measured = pd.to_numeric(rows[column], errors="coerce").to_numpy(float)
        for tier, pred in predictions.items():
            if figure not in pred:
                continue
            err = signed_errors(pred[figure], measured)
            long.append(pd.DataFrame({
                "figure": figure, "tier": tier, "group": groups, "lengths": kinds,
                "experiment": label.to_numpy(),
                "torch_version": rows["torch_version"].to_numpy(),
                "measured": measured, "predicted": pred[figure].to_numpy(float), "error_pct": err}))
    errors = pd.concat(long, ignore_index=True) if long else pd.DataFrame(
        columns=["figure", "tier", "group", "lengths", "experiment", "measured", "predicted", "error_pct"])
    lines = []
    order = [g for g in (*GROUPS, "unreadable") if g in set(groups)]
    kind_order = [k for k in (*LENGTH_KINDS, *sorted(set(kinds) - set(LENGTH_KINDS))) if k in kinds]
    for (figure, tier), part in errors.groupby(["figure", "tier"], sort=False):
        for kind in kind_order:
            of_kind = part[part["lengths"] == kind]
            for group in ("all", *order):
                sel = of_kind if group == "all" else of_kind[of_kind["group"] == group]
                stats = summary(sel["error_pct"].to_numpy(float))
                if stats["n"]:
                    lines.append({"figure": figure, "tier": tier, "group": group,
                                  "lengths": kind, **stats})
    notes = []
    n_upper = sum(k == "upper-bound" for k in kinds)
    if n_upper:
        notes.append(f"{n_upper} row(s) are upper-bound lengths, reported apart: "
                     + UPPER_BOUND_NEEDS.split(": ", 1)[1])
    return Accuracy(errors=errors, table=pd.DataFrame(lines), notes=notes)


COLUMNS: tuple[tuple[str, str], ...] = (
    ("n", "rows"), ("median_signed", "median error"), ("median_ape", "median abs"),
    ("p95_ape", "P95 abs"), ("max_ape", "max abs"), ("within_3pct", "within 3 %"),
    ("under_share", "under"),
)
"""`summary`'s statistics as the tables show them (terminal and markdown)."""
FIGURE_NAMES = {"reserved": "reserved peak", "device": "device peak", "allocated": "allocated peak",
                "after_step": "allocated after the step"}


def cell(key: str, value: float, unit: str = " %") -> str:
    """One statistic as text: counts whole, shares in %, errors in % with one decimal (`unit`
    after them; the terminal table puts it in the header instead)."""
    if key == "n":
        return f"{int(value)}"
    if key in ("within_3pct", "under_share"):
        return f"{value:.0%}"
    return (f"{value:+.1f}" if key == "median_signed" else f"{value:.1f}") + unit


def markdown(table: pd.DataFrame) -> str:
    """The summary table as GitHub markdown (what README's accuracy section shows)."""
    head = ["figure", "tier", "group", "lengths", *(h for _, h in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rec in table.to_dict("records"):
        cells = [FIGURE_NAMES.get(rec["figure"], rec["figure"]), rec["tier"], rec["group"],
                 length_label(rec.get("lengths")), *(cell(key, rec[key]) for key, _ in COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    if any(rec.get("lengths") == "upper-bound" for rec in table.to_dict("records")):
        lines += ["", UPPER_BOUND_NEEDS]
    return "\n".join(lines)


def length_label(kind) -> str:
    """A table's `lengths` cell: "exact", or "upper bound" (`UPPER_BOUND_NEEDS` says why)."""
    return "upper bound" if kind == "upper-bound" else "exact" if kind in (None, "exact") else str(kind)
