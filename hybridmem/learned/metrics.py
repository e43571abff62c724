"""Error metrics of a peak predictor against measured peaks.

APE = |predicted - measured| / measured. Under-prediction is the dangerous error (the job
OOMs although we said it fits), so its share is reported on its own.

Fit verdict near the limit: for every row we ask "does it fit on a GPU of capacity
C = measured x m?" for margins m in `VERDICT_MARGINS`. The truth is `measured <= C` (yes for
m >= 1, no for m < 1); the predictor says `predicted <= C`. The accuracy over all rows and
margins is the share of correct verdicts when the GPU is within +-10 % of the peak, the
region where the answer matters. m = 1.0 is left out: there the truth is "fits" by a zero
margin and any over-prediction, however small, counts as wrong.
"""

from __future__ import annotations

import numpy as np

VERDICT_MARGINS: tuple[float, ...] = (0.90, 0.95, 1.05, 1.10)


def verdict_accuracy(predicted: np.ndarray, measured: np.ndarray,
                     margins: tuple[float, ...] = VERDICT_MARGINS) -> float:
    """Share of correct fits / does-not-fit verdicts at capacities measured x margins."""
    correct = [(predicted <= measured * m) == (m >= 1.0) for m in margins]
    return float(np.mean(np.concatenate(correct)))


def error_metrics(predicted, measured) -> dict[str, float]:
    """MAPE, median and P95 APE (in %), under-prediction share, verdict accuracy, count."""
    predicted = np.asarray(predicted, dtype=float)
    measured = np.asarray(measured, dtype=float)
    assert predicted.shape == measured.shape and len(measured), (predicted.shape, measured.shape)
    ape = np.abs(predicted - measured) / measured * 100
    return {
        "mape": float(ape.mean()),
        "median_ape": float(np.median(ape)),
        "p95_ape": float(np.percentile(ape, 95)),
        "under_share": float(np.mean(predicted < measured)),
        "verdict_acc": float(verdict_accuracy(predicted, measured)),
        "n": float(len(measured)),
    }


def bound_coverage(upper, measured) -> float:
    """Share of rows whose measured peak is at or below the upper bound (target: >= 0.95)."""
    return float(np.mean(np.asarray(measured, float) <= np.asarray(upper, float)))
