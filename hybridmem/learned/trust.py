"""Where the residual is trusted, per job group, by its held-out evidence against the base tier.

A residual learned mostly on LoRA rows can improve LoRA and hurt full fine-tuning (the
published rows: LoRA within 1 %, full -7.7 % where the analytic tier was -1.6 %). So the
decision is per target and per job group (`adapters.GROUPS`), from every held-out evaluation
that has rows of the group: grouped cross-validation, and the forward torch-version hold-out
when the rows span two or more versions. Rule: the residual applies to a group when its
held-out MAPE is below the base tier's in each of them; elsewhere the base tier answers. A
group with no held-out row has no evidence, and the base tier answers.

A torch version outside the training set is not a refusal: it is a feature, and the evidence
says how far the residual carried to a newer version before (`describe`).

`answer` is the arithmetic of a residual's answer (the expected peak and its upper bound), the
same for `predictor.apply_model` and the held-out evaluations, so what is evaluated is what
`predict` serves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy / pandas load in the functions that compute: the chooser reads the
    # decisions below on every `predict`, and pandas alone costs ~0.5 s to import
    import numpy as np
    import pandas as pd

KINDS: dict[str, str] = {"cv": "grouped CV", "torch": "torch-version hold-out"}
"""Held-out evaluations the evidence comes from -> how notes name them."""

RULES: dict[str, str] = {
    "beats-base": "its held-out error is below the base tier's",
    "not-better": "its held-out error is not below the base tier's",
    "no-evidence": "no held-out row of this group",
    "not-recorded": "the model records no per-group evidence (retrain it with this hybridmem)",
    "outside-domain": "the rows of this target never had this kind of job",
}
"""Rule key (stored in the model's metadata and the prediction's extras) -> its wording."""


def group_evidence(pred: pd.DataFrame) -> dict[str, dict]:
    """Per job group of held-out predictions (`Evaluation.predictions`): rows, MAPE of the
    base (analytic) tier and of the residual, the residual's under-prediction share, and the
    coverage of its upper bound."""
    import numpy as np

    from hybridmem.learned.metrics import bound_coverage

    out = {}
    for group, part in pred.groupby("job_group", sort=True):
        m = part["measured"].to_numpy(float)
        base = np.abs(part["analytic"].to_numpy(float) - m) / m * 100
        res = np.abs(part["hybrid"].to_numpy(float) - m) / m * 100
        stats = {"rows": int(len(part)), "base_mape": float(base.mean()),
                 "residual_mape": float(res.mean()),
                 "under_share": float(np.mean(part["hybrid"].to_numpy(float) < m)),
                 "coverage": bound_coverage(part["upper"], m)}
        if "held_out" in part:
            stats["splits"] = sorted({f"{h} (trained on {t})" for h, t in
                                      zip(part["held_out"], part["trained_on"])})
        out[str(group)] = stats
    return out


def decide(evidence: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Per job group: {"apply", "rule", "evidence": {kind: stats}} from each kind's
    `group_evidence` (kinds without rows are left out)."""
    groups = sorted({g for by_group in evidence.values() for g in by_group})
    out = {}
    for group in groups:
        ev = {k: by_group[group] for k, by_group in evidence.items()
              if group in by_group and by_group[group]["rows"] > 0}
        if not ev:
            out[group] = {"apply": False, "rule": "no-evidence", "evidence": {}}
            continue
        better = all(s["residual_mape"] < s["base_mape"] for s in ev.values())
        out[group] = {"apply": better, "rule": "beats-base" if better else "not-better",
                      "evidence": ev}
    return out


def decision(trust: dict | None, target: str, group: str) -> dict:
    """The stored decision for (target, group); "no-evidence" for a group the rows never had,
    "not-recorded" for a model without a trust record."""
    if trust is None:
        return {"apply": False, "rule": "not-recorded", "evidence": {}}
    return (trust.get(target) or {}).get(group) or {"apply": False, "rule": "no-evidence",
                                                     "evidence": {}}


def coverage_source(dec: dict) -> dict | None:
    """The held-out coverage the bound states: the torch-version hold-out where it has rows of
    the group (the harder test), else grouped CV; None without evidence."""
    ev = dec.get("evidence") or {}
    for kind in ("torch", "cv"):
        if kind in ev:
            s = ev[kind]
            return {"source": KINDS[kind], "coverage": s["coverage"], "rows": s["rows"]}
    return None


def _evidence_text(ev: dict) -> str:
    parts = []
    for kind, s in ev.items():
        where = f" {'; '.join(s['splits'])}" if s.get("splits") else ""
        parts.append(f"{KINDS.get(kind, kind)}{where}: {s['rows']} rows, MAPE "
                     f"{s['residual_mape']:.1f} % vs {s['base_mape']:.1f} % for the base tier, "
                     f"bound coverage {s['coverage']:.0%}")
    return "; ".join(parts)


def describe(dec: dict, target: str, group: str) -> str:
    """One note: whether the `target` residual answers a `group` job, which rule decided it and
    on what evidence."""
    verb = "applies" if dec["apply"] else "does not apply"
    text = f"{target} residual {verb} to {group} jobs: {RULES.get(dec['rule'], dec['rule'])}"
    ev = dec.get("evidence") or {}
    return text + (f" ({_evidence_text(ev)})" if ev else "")


def answer(estimators: dict, use: dict[str, np.ndarray], X: pd.DataFrame,
           base_device: np.ndarray, base_reserved: np.ndarray) -> dict[str, np.ndarray]:
    """Expected device / reserved peaks and their upper bounds for the rows of `X`.

    `use[target]` says, per row, whether that residual applies. A reserved residual corrects
    the reserved peak and moves the device peak with it (the memory outside the allocator
    stays the base's); a device residual sets the device peak. Bounds are NaN where no
    residual applies (the base tiers state none).
    """
    import numpy as np

    n = len(X)
    base_device = np.asarray(base_device, float)
    base_reserved = np.asarray(base_reserved, float)
    outside = base_device - base_reserved
    reserved, device = base_reserved.copy(), base_device.copy()
    up_reserved = np.full(n, np.nan)
    up_device = np.full(n, np.nan)
    res = use.get("reserved", np.zeros(n, bool)) & ("reserved" in estimators)
    dev = use.get("device", np.zeros(n, bool)) & ("device" in estimators)
    if res.any():
        est = estimators["reserved"]
        reserved[res] = base_reserved[res] * np.exp(est.predict(X[res]))
        up_reserved[res] = base_reserved[res] * np.exp(est.predict_upper(X[res]))
        device[res] = reserved[res] + outside[res]
        up_device[res] = up_reserved[res] + outside[res]
    if dev.any():
        est = estimators["device"]
        device[dev] = base_device[dev] * np.exp(est.predict(X[dev]))
        up_device[dev] = base_device[dev] * np.exp(est.predict_upper(X[dev]))
    # allocated <= reserved <= device, as `predictor.corrected` keeps the breakdown
    device = np.maximum(device, reserved)
    up_device = np.where(np.isnan(up_device), np.nan, np.maximum(up_device, device))
    up_reserved = np.where(np.isnan(up_reserved), np.nan, np.maximum(up_reserved, reserved))
    return {"device": device, "reserved": reserved, "device_upper": up_device,
            "reserved_upper": up_reserved}


def outside_domain(row: dict, domain: dict) -> list[str]:
    """'field=value (trained: a, b)' for each categorical field the rows never had."""
    out = []
    for name, seen in domain.items():
        value = row.get(name)
        if seen and value is not None and str(value) not in seen:
            out.append(f"{name}={value} (trained: {', '.join(seen)})")
    return out
