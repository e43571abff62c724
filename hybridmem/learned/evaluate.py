"""Held-out evaluation: grouped cross-validation by model shape, tiers side by side.

Groups are model shapes (a hash of the model config), so no architecture/size is ever in
both the training and the test fold: the numbers say how the residual does on a model it
never saw, which is what a user with a new model gets. When every row has the same model (the
published benchmarks) the groups are configurations (`dataset.config_groups`): no job is in
the training and the test fold at once.

`forward_held_out` holds out torch versions instead, forward in time only: each later version
is predicted by a residual trained on the strictly older ones, as it would have been when that
version came out (what a maintainer needs to know when a new PyTorch is released).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from hybridmem.errors import SpecError
from hybridmem.learned.conformal import feature_groups
from hybridmem.learned.dataset import TARGET_COLUMNS
from hybridmem.learned.features import FeatureTable, major_minor
from hybridmem.learned.metrics import bound_coverage, error_metrics

METHODS: tuple[str, ...] = ("analytic", "trace", "hybrid")


@dataclass
class Evaluation:
    predictions: pd.DataFrame
    """One row per held-out measurement: fold, group (the CV group), job_group (full, lora,
    ...), torch (major.minor), model_name, measured, one column per method, upper."""
    table: dict[str, dict[str, float]]
    """method -> metrics over all held-out rows (trace only where trace rows exist)."""
    per_fold: list[dict[str, float]] = field(default_factory=list)
    target: str = "device"


def trace_baseline(rows: pd.DataFrame, all_rows: pd.DataFrame, target: str) -> np.ndarray:
    """The trace tier's peak for each row's spec, from trace rows of the dataset (NaN if none).

    A trace row is never its own baseline: rows that are themselves trace rows get NaN.
    """
    column = TARGET_COLUMNS[target]
    trace = all_rows[(all_rows["source"] == "trace") & (all_rows["outcome"] == "ok")]
    lookup = trace.groupby("spec_hash")[column].median()
    values = rows["spec_hash"].map(lookup).to_numpy(float, copy=True)
    values[(rows["source"] == "trace").to_numpy()] = np.nan
    return values


def held_out_predictions(table: FeatureTable, trace: np.ndarray, est, target: str, rows: np.ndarray,
                         groups: np.ndarray, fold: int = 0) -> pd.DataFrame:
    """The `Evaluation.predictions` rows of `table` picked by `rows` (positions or a mask):
    measured peak, analytic base, trace baseline, `est`'s expected peak and its upper bound."""
    base = (table.base_device if target == "device" else table.base_reserved)[rows]
    X = table.X.iloc[rows]
    extra = {"_row": table.rows["_row"].to_numpy()[rows]} if "_row" in table.rows else {}
    return pd.DataFrame({**extra,
        "fold": fold, "group": groups[rows], "job_group": feature_groups(X),
        "torch": [major_minor(v) for v in table.rows["torch_version"].to_numpy()[rows]],
        "model_name": table.rows["model_name"].to_numpy()[rows],
        "measured": table.rows[TARGET_COLUMNS[target]].to_numpy(float)[rows],
        "analytic": base, "trace": trace[rows],
        "hybrid": base * np.exp(est.predict(X)), "upper": base * np.exp(est.predict_upper(X)),
    })


def summarise(pred: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Metrics per method over the rows where that method has a value."""
    out: dict[str, dict[str, float]] = {}
    for method in METHODS:
        ok = pred[method].notna()
        if ok.any():
            out[method] = error_metrics(pred.loc[ok, method], pred.loc[ok, "measured"])
    if "hybrid" in out:
        out["hybrid"]["bound_coverage"] = bound_coverage(pred["upper"], pred["measured"])
        out["hybrid"]["upper_mape"] = error_metrics(pred["upper"], pred["measured"])["mape"]
    return out


def oom_verdicts(oom: FeatureTable, est, done: np.ndarray, train_groups: set[str]) -> pd.DataFrame:
    """Device-peak predictions for OOM rows of shapes `est` was not trained on (not yet `done`)."""
    groups = oom.groups
    pick = ~done & np.array([g not in train_groups for g in groups])
    done |= pick
    X = oom.X[pick]
    return pd.DataFrame({
        "group": groups[pick], "capacity": oom.rows["gpu_memory_bytes"].to_numpy(float)[pick],
        "analytic": oom.base_device[pick],
        "hybrid": oom.base_device[pick] * np.exp(est.predict(X)) if pick.any() else [],
        "upper": oom.base_device[pick] * np.exp(est.predict_upper(X)) if pick.any() else [],
    })


def add_oom_metrics(table: dict[str, dict[str, float]], ooms: pd.DataFrame) -> None:
    """`oom_caught`: share of rows that ran out of memory which the method says do not fit.

    The truest verdict test there is: the GPU said no at its real limit (`gpu_memory_bytes`).
    """
    if ooms.empty:
        return
    for method, column in (("analytic", "analytic"), ("hybrid", "hybrid")):
        if method in table:
            table[method]["oom_caught"] = float(np.mean(ooms[column] > ooms["capacity"]))
            table[method]["n_oom"] = float(len(ooms))
    if "hybrid" in table:
        table["hybrid"]["oom_caught_by_bound"] = float(np.mean(ooms["upper"] > ooms["capacity"]))


def cross_validate(table: FeatureTable, all_rows: pd.DataFrame, target: str = "device",
                   n_splits: int = 5, estimator_params: dict | None = None,
                   oom: FeatureTable | None = None) -> Evaluation:
    """GroupKFold over model shapes; each fold fits a fresh residual on the other shapes.

    With `oom` (features of rows that ran out of memory) and the device target, each OOM row is
    also judged by a fold model that never saw its shape (`oom_caught` in the table).
    """
    from sklearn.model_selection import GroupKFold

    from hybridmem.learned.model import ResidualRegressor

    groups = table.groups
    n_groups = len(set(groups))
    if n_groups < 2:
        raise SpecError("data", f"{n_groups} model shape",
                        reason=f"held-out evaluation needs rows of at least 2 {table.group_kind}s")
    y = table.target(target)
    trace = trace_baseline(table.rows, all_rows, target)
    parts, per_fold, oom_parts = [], [], []
    oom_done = np.zeros(len(oom.rows) if oom is not None else 0, dtype=bool)
    splitter = GroupKFold(n_splits=min(n_splits, n_groups))
    for fold, (train, test) in enumerate(splitter.split(table.X, y, groups)):
        est = ResidualRegressor(**(estimator_params or {})).fit(
            table.X.iloc[train], y[train], groups=groups[train])
        part = held_out_predictions(table, trace, est, target, test, groups, fold)
        parts.append(part)
        if oom is not None and target == "device":
            oom_parts.append(oom_verdicts(oom, est, oom_done, set(groups[train])))
        per_fold.append({f"{m}_{k}": v for m, metrics in summarise(part).items()
                         for k, v in metrics.items()})
    pred = pd.concat(parts, ignore_index=True)
    result = summarise(pred)
    if oom_parts:
        add_oom_metrics(result, pd.concat(oom_parts, ignore_index=True))
    return Evaluation(predictions=pred, table=result, per_fold=per_fold, target=target)


def version_key(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a torch version for ordering releases; None when it cannot be read."""
    mm = major_minor(version)
    return None if mm is None else tuple(int(p) for p in mm.split("."))


def forward_splits(versions) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(held-out major.minor, train mask, test mask) for each torch version that has an older
    one: the training rows are strictly older releases, never the held-out or a newer one.
    Rows whose version cannot be read are in neither."""
    keys = [version_key(v) for v in versions]
    out = []
    for held in sorted({k for k in keys if k is not None}):
        train = np.array([k is not None and k < held for k in keys])
        test = np.array([k == held for k in keys])
        if train.any():
            out.append((f"{held[0]}.{held[1]}", train, test))
    return out


def forward_held_out(table: FeatureTable, all_rows: pd.DataFrame, target: str = "device",
                     estimator_params: dict | None = None) -> Evaluation | None:
    """Each later torch version predicted by a residual fitted on the older ones
    (`forward_splits`); None when the rows span a single version. `fold` counts the splits,
    `held_out` names the version."""
    from hybridmem.learned.model import ResidualRegressor

    splits = forward_splits(table.rows["torch_version"].tolist())
    if not splits:
        return None
    y = table.target(target)
    groups = table.groups
    trace = trace_baseline(table.rows, all_rows, target)
    parts, per_fold = [], []
    for fold, (version, train, test) in enumerate(splits):
        est = ResidualRegressor(**(estimator_params or {})).fit(
            table.X[train], y[train], groups=groups[train])
        part = held_out_predictions(table, trace, est, target, test, groups, fold)
        part["held_out"] = version
        part["trained_on"] = ",".join(sorted(part_versions(table, train), key=version_key))
        parts.append(part)
        per_fold.append({f"{m}_{k}": v for m, metrics in summarise(part).items()
                         for k, v in metrics.items()})
    pred = pd.concat(parts, ignore_index=True)
    return Evaluation(predictions=pred, table=summarise(pred), per_fold=per_fold, target=target)


def part_versions(table: FeatureTable, mask: np.ndarray) -> set[str]:
    """major.minor of the torch versions of the rows picked by `mask`."""
    return {v for v in (major_minor(x) for x in table.rows["torch_version"].to_numpy()[mask]) if v}


def evaluate_fitted(table: FeatureTable, all_rows: pd.DataFrame, est, target: str,
                    exclude_groups: set[str] = frozenset()) -> Evaluation:
    """Metrics of an already-fitted residual on rows whose model shape it was not trained on."""
    groups = table.groups
    keep = np.array([g not in exclude_groups for g in groups])
    if not keep.any():
        raise SpecError("data", f"{len(groups)} rows",
                        reason="every row's model shape was in the model's training data; "
                               "no held-out rows to compare on")
    pred = held_out_predictions(table, trace_baseline(table.rows, all_rows, target), est, target,
                                keep, groups)
    return Evaluation(predictions=pred, table=summarise(pred), target=target)


def plot_predictions(pred: pd.DataFrame, path: str, title: str = "",
                     methods: tuple[str, ...] = METHODS) -> str:
    """Predicted vs measured peak (log-log), one colour per method, y = x and +-10 % lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = 2**30
    fig, ax = plt.subplots(figsize=(6, 6))
    for method, marker in zip(methods, "o^sDvP<>"):
        ok = pred[method].notna() if method in pred else None
        if ok is not None and ok.any():
            ax.scatter(pred.loc[ok, "measured"] / gib, pred.loc[ok, method] / gib, s=14,
                       marker=marker, alpha=0.7, label=method)
    lo = max(pred["measured"].min() / gib * 0.8, 1e-6)
    hi = pred["measured"].max() / gib * 1.25
    xs = np.array([lo, hi])
    ax.plot(xs, xs, "k-", lw=1, label="y = x")
    for f, label in ((0.9, "+-10 %"), (1.1, None)):
        ax.plot(xs, xs * f, "k:", lw=0.8, label=label)
    ax.set(xscale="log", yscale="log", xlabel="measured peak (GiB)", ylabel="predicted peak (GiB)",
           title=title or "predicted vs measured (held-out model shapes)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
