"""`hybridmem evaluate`: tiers side by side on held-out model shapes, or registry entries A vs B.

Without `--model`, a fresh residual is cross-validated (GroupKFold by model shape). With one or
more `--model`, the saved entries are scored on the rows whose model shape none of them was
trained on, so A and B are compared on the same held-out data (the retraining workflow in
models/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from hybridmem.errors import SpecError
from hybridmem.learned import dataset, registry
from hybridmem.learned.evaluate import (METHODS, cross_validate, evaluate_fitted,
                                        plot_predictions)
from hybridmem.learned.features import BaseFn
from hybridmem.learned.train import (build_oom_table, build_table_for, is_calibrated,
                                     pick_sources)


@dataclass
class Comparison:
    table: dict[str, dict[str, float]]
    """Row label (analytic, trace, hybrid or hybrid:NAME) -> metrics."""
    predictions: pd.DataFrame
    target: str
    notes: list[str] = field(default_factory=list)
    plot_path: str | None = None


def _compare_models(table, df, names: list[str], target: str) -> tuple[dict, pd.DataFrame, list[str]]:
    models = [registry.load(n) for n in names]
    notes = []
    for m in models:
        if target not in m.estimators:
            raise SpecError("target", target, list(m.estimators), reason=f"not trained in {m.name}")
        if not m.metadata.get("calibrated_to_gpu"):
            notes.append(f"{m.name} is NOT calibrated to real GPUs (sources: "
                         f"{', '.join(m.metadata.get('sources', []))})")
    exclude = set().union(*(m.metadata.get("training_groups", []) for m in models))
    evals = [evaluate_fitted(table, df, m.estimators[target], target, exclude) for m in models]
    first = evals[0]
    out = {k: v for k, v in first.table.items() if k != "hybrid"}
    pred = first.predictions.drop(columns=["hybrid", "upper"])
    for m, ev in zip(models, evals):
        out[f"hybrid:{m.name}"] = ev.table["hybrid"]
        pred[f"hybrid:{m.name}"] = ev.predictions["hybrid"].to_numpy()
    notes.append(f"{len(pred)} held-out rows ({pred['group'].nunique()} model shapes none of the "
                 "models was trained on)")
    return out, pred, notes


def compare(data: str | Path, *, models: list[str] | tuple[str, ...] = (), target: str = "device",
            n_splits: int = 5, base_fn: BaseFn | None = None, plot: str | None = None,
            estimator_params: dict | None = None, with_trace: bool = False) -> Comparison:
    """The evaluation table (and optional plot) for `hybridmem evaluate`.

    `with_trace` adds the trace-peak features (as `train --trace-features`); it is switched on
    when a compared model was trained with them.
    """
    if target not in registry.TARGETS:
        raise SpecError("target", target, registry.TARGETS)
    for name in models:  # fail on a bad model before the (slower) featurisation
        with_trace |= bool(registry.read_metadata(name).get("trace_features"))
    df = load_with_ids(data)
    sources = pick_sources(df)
    table = build_table_for(df, sources, base_fn, with_trace, (target,))
    notes = [] if is_calibrated(sources) else [
        f"rows are {'/'.join(sources)} output, not real CUDA measurements: "
        "errors are against a simulation, not a GPU"]
    if models:
        result, pred, more = _compare_models(table, df, list(models), target)
        notes += more
        methods = tuple(k for k in ("analytic", "trace") if k in result) + tuple(
            k for k in result if k.startswith("hybrid:"))
    else:
        ev = cross_validate(table, df, target, n_splits, estimator_params,
                            build_oom_table(df, sources, base_fn, with_trace))
        result, pred, methods = ev.table, ev.predictions, METHODS
        kind = table.group_kind
        notes.append(f"{len(pred)} held-out rows, {pred['group'].nunique()} {kind}s, "
                     f"{pred['fold'].nunique()} folds (GroupKFold by {kind})")
    if plot:
        plot_predictions(pred, plot, f"{target} peak, held-out model shapes", methods)
    return Comparison(table=result, predictions=pred, target=target, notes=notes, plot_path=plot)


def default_target(data: str | Path) -> str:
    """The device peak when the dataset's target rows measured it, else the reserved peak."""
    df = dataset.load(data)
    measured = dataset.measured_targets(df[df["source"].isin(pick_sources(df))])
    return "device" if "device" in measured or not measured else measured[0]


def load_with_ids(data: str | Path) -> pd.DataFrame:
    """The dataset with `_row`, each row's position: held-out predictions carry it back to the
    row they predict (`evaluate.held_out_predictions`)."""
    df = dataset.load(data)
    return df.assign(_row=np.arange(len(df)))


def hybrid_held_out(data: str | Path, rows: pd.DataFrame, n_splits: int
                    ) -> tuple[pd.DataFrame, list[str]]:
    """The hybrid tier's held-out answer for each of `rows` (rows of `load_with_ids(data)`)
    and each target they measured: grouped CV where every fold is answered as `predict
    --method hybrid` would (`holdout.cross_validated`: the residual only for the job groups
    the fold model's own evidence trusts)."""
    from hybridmem.learned.holdout import cross_validated
    from hybridmem.learned.tier_rows import nan_rows

    df = load_with_ids(data)
    out = nan_rows(len(rows))
    notes = []
    position = {int(r): i for i, r in enumerate(rows["_row"])}
    for target in dataset.measured_targets(rows):
        try:
            pred, more = cross_validated(rows, df, target, n_splits)
        except SpecError as err:
            notes.append(f"hybrid {target}: {err}")
            continue
        notes += more
        out.loc[[position[int(r)] for r in pred["_row"]], target] = pred["predicted"].to_numpy()
        measured = int(pd.to_numeric(rows[dataset.TARGET_COLUMNS[target]], errors="coerce")
                       .gt(0).sum())
        if measured > len(pred):
            notes.append(f"hybrid {target}: {measured - len(pred)} measured row(s) without an "
                         "analytic base are not covered")
    return out, notes


def tier_accuracy(data: str | Path, *, tiers: tuple[str, ...] = ("analytic", "trace"),
                  hybrid: bool = True, n_splits: int = 5, use_cache: bool = True,
                  progress=None):
    """`accuracy.Accuracy` of each tier (and the held-out hybrid, `hybrid_held_out`) on the
    real-GPU rows of `data` (the rows of the dataset's target source when it has none)."""
    from hybridmem.learned.accuracy import accuracy
    from hybridmem.learned.tier_rows import tier_rows
    from hybridmem.predict import METHODS

    for tier in tiers:
        if tier not in METHODS or tier == "hybrid":
            raise SpecError("tiers", tier, [m for m in METHODS if m != "hybrid"])
    df = load_with_ids(data)
    sources = pick_sources(df)
    rows = df[df["source"].isin(sources) & (df["outcome"] == "ok")].reset_index(drop=True)
    if rows.empty:
        raise SpecError("data", str(data), reason=f"no ok row among sources {list(sources)}")
    preds = {t: tier_rows(rows, t, use_cache=use_cache,
                          progress=(lambda i, n, m, t=t: progress(t, i, n, m)) if progress else None)
             for t in tiers}
    notes = [] if is_calibrated(sources) else [
        f"rows are {'/'.join(sources)} output, not real GPU measurements"]
    for t, p in preds.items():
        failed = p["error"] != ""
        if failed.any():
            first = p.loc[failed, "error"].iloc[0]
            notes.append(f"{t}: {int(failed.sum())} row(s) not priced, e.g. {first}")
    if hybrid:
        preds["hybrid"], more = hybrid_held_out(data, rows, n_splits)
        notes += more
    result = accuracy(rows, preds)
    result.notes = notes + result.notes
    return result
