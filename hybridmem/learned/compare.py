"""`hybridmem evaluate`: tiers side by side on held-out model shapes, or registry entries A vs B.

Without `--model`, a fresh residual is cross-validated (GroupKFold by model shape). With one or
more `--model`, the saved entries are scored on the rows whose model shape none of them was
trained on, so A and B are compared on the same held-out data (the retraining workflow in
models/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from hybridmem.errors import SpecError
from hybridmem.learned import dataset, registry
from hybridmem.learned.evaluate import (METHODS, cross_validate, evaluate_fitted,
                                        plot_predictions)
from hybridmem.learned.features import BaseFn
from hybridmem.learned.train import build_oom_table, build_table_for, is_real, pick_sources


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
    df = dataset.load(data)
    sources = pick_sources(df)
    table = build_table_for(df, sources, base_fn, with_trace, (target,))
    notes = [] if is_real(sources) else [
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
        notes.append(f"{len(pred)} held-out rows, {pred['group'].nunique()} model shapes, "
                     f"{pred['fold'].nunique()} folds (GroupKFold by model shape)")
    if plot:
        plot_predictions(pred, plot, f"{target} peak, held-out model shapes", methods)
    return Comparison(table=result, predictions=pred, target=target, notes=notes, plot_path=plot)
