"""Per-group conformal margins of the residual's upper bound, and the groups themselves.

The bound is the point residual plus a margin: the finite-sample alpha-quantile of
out-of-fold residuals `y - oof(x)` (CV+, Barber et al. 2021, "Predictive inference with the
jackknife+", eq. 2). One margin per job group (full, LoRA, DoRA, other PEFT, partial): the
Mondrian conformal predictor of Vovk, Gammerman & Shafer ("Algorithmic Learning in a Random
World", 2005, sec. 4.5), whose coverage holds within each category. A group whose residuals
are biased (full fine-tuning, over-corrected by a residual learned mostly on LoRA rows) gets
its own wider margin instead of borrowing LoRA's narrow one.

Small groups: the finite-sample quantile needs ceil((n + 1) alpha) <= n, i.e. n >= 19 rows at
alpha = 0.95; below that it is infinite. Such a group gets the larger of its largest residual
and the pooled margin (every group's residuals together), and its coverage is only what
held-out data shows (`trust`). A group with no training row gets the largest margin of all.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from hybridmem.adapters import group_of

if TYPE_CHECKING:  # only annotations here: pandas loads where a frame is built
    import pandas as pd

POOLED = "*"
"""Key of the margin over every group's residuals together."""


def min_rows(alpha: float) -> int:
    """Rows for which the finite-sample alpha-quantile is finite: ceil((n + 1) alpha) <= n."""
    return math.ceil(alpha / (1 - alpha) - 1e-9)


def conformal_quantile(scores, alpha: float) -> float:
    """The ceil((n + 1) alpha)-th smallest score (Barber et al. 2021, eq. 2); the largest score
    when there are fewer than `min_rows(alpha)` of them; NaN for none."""
    s = np.sort(np.asarray(scores, dtype=float))
    n = len(s)
    if n == 0:
        return float("nan")
    k = math.ceil((n + 1) * alpha - 1e-9)
    return float(s[min(k, n) - 1])


def group_margins(scores, strata, alpha: float) -> dict[str, float]:
    """Margin per job group (and `POOLED`), never below 0 (the bound is at least the point)."""
    scores = np.asarray(scores, dtype=float)
    strata = np.asarray(strata, dtype=object)
    pooled = max(0.0, conformal_quantile(scores, alpha))
    out = {POOLED: pooled}
    for group in sorted(set(strata)):
        mine = scores[strata == group]
        q = max(0.0, conformal_quantile(mine, alpha))
        out[str(group)] = q if len(mine) >= min_rows(alpha) else max(q, pooled)
    return out


def margin_for(margins: dict[str, float], group: str) -> float:
    """The margin of `group`; the largest one for a group no training row belonged to."""
    if group in margins:
        return margins[group]
    return max(margins.values()) if margins else 0.0


def feature_groups(X: pd.DataFrame) -> np.ndarray:
    """`adapters.GROUPS` entry of each feature row, from its `train` and `peft_type` features
    (the same rule as `adapters.job_group` on the spec)."""
    n = len(X)
    train = X["train"].astype(str).to_numpy() if "train" in X else np.array(["full"] * n)
    kinds = X["peft_type"].astype(str).to_numpy() if "peft_type" in X else np.array(["none"] * n)
    return np.array([group_of(None if k in ("none", "nan", "None") else k, t)
                     for k, t in zip(kinds, train)], dtype=object)
