"""`hybridmem train`: dataset -> features -> held-out CV -> fit -> registry entry + MLflow run.

Only real-GPU rows calibrate a model to GPUs: our own `cuda` measurements and `published` real
runs of other projects (`dataset.REAL_SOURCES`). If the dataset has any, only those are used (a
model never mixes simulated and measured targets); otherwise the trace rows (else the analytic
rows) are used and the entry says `calibrated_to_gpu: false`, which `predict` repeats loudly.
A target that no real row measured is not trained. Each target's residual has its own
held-out evaluations (grouped CV; the forward torch-version hold-out when the rows span two or
more versions), the kinds of job its rows had (`target_domains`) and, from the evaluations,
the job groups it is trusted on (`trust`).
"""

from __future__ import annotations

import datetime as dt
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from hybridmem.environment import installed
from hybridmem.errors import SpecError
from hybridmem.learned import dataset, registry
from hybridmem.learned.evaluate import (Evaluation, cross_validate, forward_held_out,
                                        plot_predictions)
from hybridmem.learned.features import NEIGHBOUR_FEATURES, RANGE_FEATURES, BaseFn, FeatureTable
from hybridmem.tracking import start_run

TARGET_CHOICES: tuple[str, ...] = ("device", "reserved", "both")


@dataclass
class TrainResult:
    path: Path
    metadata: dict
    evaluations: dict[str, Evaluation] = field(default_factory=dict)
    importances: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    plot_path: str | None = None


def pick_sources(df: pd.DataFrame) -> tuple[str, ...]:
    """The sources whose rows are targets: the real-GPU ones present (cuda, published) if any,
    else "trace", else "analytic".

    Real and simulated sources are never mixed: a simulated peak is not a noisy measurement of
    a real one.
    """
    present = set(df["source"])
    real = tuple(s for s in dataset.REAL_SOURCES if s in present)
    if real:
        return real
    return next((s,) for s in dataset.SOURCES if s in present)


def is_calibrated(sources: tuple[str, ...]) -> bool:
    """True when every target row came from a real GPU."""
    return bool(sources) and set(sources) <= set(dataset.REAL_SOURCES)


def pick_targets(df: pd.DataFrame, sources: tuple[str, ...], wanted: tuple[str, ...]
                 ) -> tuple[str, ...]:
    """The wanted targets that the rows of `sources` measured (a clear error if none)."""
    measured = dataset.measured_targets(df[df["source"].isin(sources)])
    targets = tuple(t for t in wanted if t in measured)
    if not targets:
        raise SpecError("target", ",".join(wanted), measured or ("none",),
                        reason=f"no {'/'.join(sources)} row measured it")
    return targets


# What a residual was trained on, beyond the numeric ranges: a spec outside it gets the
# analytic estimate (the trees never saw that kind of job), with a note.
DOMAIN_FIELDS: tuple[str, ...] = ("train", "precision", "optimizer", "strategy", "loop")


def domain(table: FeatureTable) -> dict[str, list]:
    """Distinct values of `DOMAIN_FIELDS` and model types over the training rows."""
    out = {f: sorted({str(v) for v in table.X[f].dropna()}) for f in DOMAIN_FIELDS if f in table.X}
    out["model_type"] = _distinct(table.rows["model_type"]) if "model_type" in table.rows else []
    return out


def union_domain(domains: dict[str, dict[str, list]]) -> dict[str, list]:
    """Values any target's rows had, per field (a job outside it gets no residual at all)."""
    fields = sorted({f for d in domains.values() for f in d})
    return {f: sorted({v for d in domains.values() for v in d.get(f, [])}) for f in fields}


@dataclass
class Fitted:
    """What training learns from the rows, per target: the residual, its held-out evaluations,
    the kinds of job its rows had and the job groups its evidence trusts it on."""

    estimators: dict
    evaluations: dict[str, Evaluation] = field(default_factory=dict)
    """Grouped cross-validation per target."""
    forward: dict[str, Evaluation] = field(default_factory=dict)
    """Forward torch-version hold-out per target (only where the rows span >= 2 versions)."""
    domains: dict[str, dict] = field(default_factory=dict)
    group_kinds: dict[str, str] = field(default_factory=dict)
    """What grouped CV held out per target: model shapes or configurations."""
    trust: dict[str, dict[str, dict]] = field(default_factory=dict)
    """target -> job group -> `trust.decide` entry."""
    notes: list[str] = field(default_factory=list)


def fit_residuals(tables: dict[str, FeatureTable], df: pd.DataFrame, n_splits: int = 5,
                  estimator_params: dict | None = None,
                  oom: FeatureTable | None = None) -> Fitted:
    """Evaluate held out, decide trust per group, and fit each target's residual on all its rows.

    The same steps for `hybridmem train` and for every training split of the held-out
    evaluations (`holdout`), so a split's answers follow the policy `predict` would apply.
    """
    from hybridmem.learned.model import ResidualRegressor
    from hybridmem.learned.trust import decide, group_evidence

    out = Fitted(estimators={})
    for t, tb in tables.items():
        evidence = {}
        if len(set(tb.groups)) >= 2:
            out.evaluations[t] = cross_validate(tb, df, t, n_splits, estimator_params,
                                                oom if t == "device" else None)
            evidence["cv"] = group_evidence(out.evaluations[t].predictions)
        else:
            out.notes.append(f"{t} peak: only one {tb.group_kind}; no grouped CV is possible")
        forward = forward_held_out(tb, df, t, estimator_params)
        if forward is not None:
            out.forward[t] = forward
            evidence["torch"] = group_evidence(forward.predictions)
        out.trust[t] = decide(evidence)
        out.domains[t] = domain(tb)
        out.group_kinds[t] = tb.group_kind
        out.estimators[t] = ResidualRegressor(**(estimator_params or {})).fit(
            tb.X, tb.target(t), tb.groups)
    return out


def combined(tables: dict[str, FeatureTable]) -> FeatureTable:
    """One table of every target's rows (a row measuring two targets once), for metadata."""
    parts = list(tables.values())
    X = pd.concat([tb.X for tb in parts], ignore_index=True)
    rows = pd.concat([tb.rows for tb in parts], ignore_index=True)
    keep = ~rows["_row"].duplicated().to_numpy() if "_row" in rows else np.ones(len(rows), bool)
    return FeatureTable(
        X=X[keep].reset_index(drop=True), rows=rows[keep].reset_index(drop=True),
        base_device=np.concatenate([tb.base_device for tb in parts])[keep],
        base_reserved=np.concatenate([tb.base_reserved for tb in parts])[keep],
        dropped={k: v for tb in parts for k, v in tb.dropped.items()})


def neighbour_rows(table: FeatureTable) -> list[dict]:
    """The training rows' main spec features (the user's spec is compared with them at
    predict time: how far it is from what the model saw)."""
    cols = [c for c in NEIGHBOUR_FEATURES if c in table.X]
    names = table.rows["experiment"] if "experiment" in table.rows else table.rows["model_name"]
    out = []
    for label, (_, x) in zip(names.fillna("").astype(str), table.X[cols].iterrows()):
        out.append({"label": label, **{c: (x[c].item() if hasattr(x[c], "item") else x[c])
                                        for c in cols}})
    # one entry per distinct spec (re-runs share it; the first label is kept)
    unique: dict[str, dict] = {}
    for r in out:
        key = json.dumps({k: v for k, v in r.items() if k != "label"}, sort_keys=True, default=str)
        unique.setdefault(key, r)
    return list(unique.values())


def _version(pkg: str) -> str:
    return installed(pkg) or "unknown"


def _distinct(series: pd.Series) -> list[str]:
    """Sorted distinct non-missing values as text (versions, GPU names)."""
    return sorted({str(v) for v in series if isinstance(v, str) or pd.notna(v)})


def _ranges(X: pd.DataFrame) -> dict[str, list[float]]:
    return {c: [float(X[c].min()), float(X[c].max())] for c in RANGE_FEATURES if c in X}


def build_metadata(df: pd.DataFrame, table: FeatureTable, sources: tuple[str, ...],
                   targets: tuple[str, ...], evaluations: dict[str, Evaluation],
                   hyper: dict, data_path: str, fitted: Fitted | None = None) -> dict:
    """Everything `predict` and a reviewer need to trust (or not) this model."""
    rows = table.rows
    fitted = fitted or Fitted(estimators={})
    return {
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hybridmem_version": _version("hybridmem"),
        "lightgbm_version": _version("lightgbm"),
        "base": "analytic",
        "targets": list(targets),
        "dataset": {"path": str(data_path), "hash": dataset.dataset_hash(df), "rows": len(df),
                    "rows_used": len(rows), "specs_without_base": len(table.dropped)},
        "sources": list(sources),
        "calibrated_to_gpu": is_calibrated(sources),
        "gpu_names": _distinct(rows["gpu_name"]),
        "default_gpu": str(rows["gpu_name"].mode().iloc[0]),
        "gpu_memory_bytes": int(rows["gpu_memory_bytes"].mode().iloc[0]),
        "gpu_memory_by_name": {str(k): int(v.mode().iloc[0])
                               for k, v in rows.groupby("gpu_name")["gpu_memory_bytes"]},
        "torch_versions": _distinct(rows["torch_version"]),
        "cuda_versions": _distinct(rows["cuda_version"]),
        "transformers_versions": _distinct(rows["transformers_version"]),
        "model_names": _distinct(rows["model_name"]),
        "training_groups": sorted(set(table.groups)),
        "group_kind": table.group_kind,
        "group_kinds": fitted.group_kinds,
        "domain": union_domain(fitted.domains) if fitted.domains else domain(table),
        "target_domains": fitted.domains,
        "neighbours": neighbour_rows(table),
        "feature_ranges": _ranges(table.X),
        "metrics": {t: ev.table for t, ev in evaluations.items()},
        "metrics_torch_held_out": {t: ev.table for t, ev in fitted.forward.items()},
        "trust": fitted.trust,
        "hyperparameters": hyper,
    }


def _log_run(run, meta: dict, evaluations: dict[str, Evaluation], importances: dict,
             plot_path: str | None, saved: Path) -> None:
    run.params({"data": meta["dataset"]["path"], "dataset_hash": meta["dataset"]["hash"],
                "rows": meta["dataset"]["rows"], "rows_used": meta["dataset"]["rows_used"],
                "sources": ",".join(meta["sources"]), "targets": ",".join(meta["targets"]),
                "torch_versions": ",".join(meta["torch_versions"]),
                "gpu_names": ",".join(meta["gpu_names"]),
                **{f"hp_{k}": v for k, v in meta["hyperparameters"].items()}})
    run.tags({"calibrated_to_gpu": str(meta["calibrated_to_gpu"]).lower(), "model": saved.name})
    for target, ev in evaluations.items():
        for fold, metrics in enumerate(ev.per_fold):
            run.metrics({f"{target}_{k}": v for k, v in metrics.items() if np.isfinite(v)}, step=fold)
        run.metrics({f"{target}_cv_{m}_{k}": v for m, d in ev.table.items() for k, v in d.items()})
    for target, table in meta.get("metrics_torch_held_out", {}).items():
        run.metrics({f"{target}_torch_{m}_{k}": v for m, d in table.items() for k, v in d.items()
                     if np.isfinite(v)})
    run.json_artifact(importances, "feature_importances.json")
    run.json_artifact(meta, "metadata.json")
    if plot_path:
        run.artifact(plot_path)
    for file in sorted(saved.iterdir()):
        run.artifact(file, subdir="model")


def _notes(sources: tuple[str, ...], table: FeatureTable) -> list[str]:
    notes = [] if is_calibrated(sources) else [
        f"trained on {'/'.join(sources)} rows, not real CUDA measurements: NOT calibrated to GPUs"]
    if table.dropped:
        notes.append(f"{len(table.dropped)} spec(s) had no base estimate and were left out, e.g. "
                     + next(iter(table.dropped.values())))
    return notes


def _save_and_log(out, estimators: dict, meta: dict, evaluations: dict[str, Evaluation],
                  importances: dict, plot: str | None, force: bool, track: bool) -> Path:
    """Plot, registry entry and MLflow run (the entry records the run id)."""
    with tempfile.TemporaryDirectory() as tmp:
        plot_path = None
        if evaluations:
            target = meta["targets"][0]
            plot_path = plot or str(Path(tmp) / "predicted_vs_measured.png")
            plot_predictions(evaluations[target].predictions, plot_path,
                             f"{target} peak, held-out shapes")
        with start_run("train", run_name=Path(out).name, enabled=track) as run:
            meta["mlflow_run_id"] = run.run_id
            saved = registry.save(out, estimators, meta, force=force)
            _log_run(run, meta, evaluations, importances, plot_path, saved)
    return saved


def train(data: str | Path, out: str | Path, *, force: bool = False, target: str = "both",
          n_splits: int = 5, base_fn: BaseFn | None = None, estimator_params: dict | None = None,
          plot: str | None = None, track: bool = True,
          with_trace: bool = False) -> TrainResult:
    """Train, evaluate on held-out model shapes, save to the registry, log to MLflow."""
    if target not in TARGET_CHOICES:
        raise SpecError("target", target, TARGET_CHOICES)
    wanted = registry.TARGETS if target == "both" else (target,)
    registry.check_out_path(out, force)  # refuse before any work: nothing is overwritten
    df = dataset.load(data)
    df = df.assign(_row=np.arange(len(df)))
    sources = pick_sources(df)
    targets = pick_targets(df, sources, wanted)
    # one table per target: a row joins the targets it measured (published rows: one of them)
    tables = {t: build_table_for(df, sources, base_fn, with_trace, (t,)) for t in targets}
    table = combined(tables)
    notes = _notes(sources, table)
    notes += [f"no {'/'.join(sources)} row measured the {t} peak: that residual is not trained"
              for t in wanted if t not in targets]
    oom = build_oom_table(df, sources, base_fn, with_trace) if "device" in tables else None
    fitted = fit_residuals(tables, df, n_splits, estimator_params, oom)
    notes += fitted.notes
    evaluations, estimators = fitted.evaluations, fitted.estimators
    meta = build_metadata(df, table, sources, targets, evaluations,
                          estimators[targets[0]].get_params(), str(data), fitted)
    meta.update(notes=notes, trace_features=with_trace)
    importances = {t: e.feature_importances() for t, e in estimators.items()}
    saved = _save_and_log(out, estimators, meta, evaluations, importances, plot, force, track)
    return TrainResult(path=saved, metadata=meta, evaluations=evaluations,
                       importances=importances, notes=notes, plot_path=plot)


def _with_trace(table: FeatureTable, df: pd.DataFrame) -> FeatureTable:
    from hybridmem.learned.features import trace_columns

    if "trace" in set(table.rows["source"]):
        raise SpecError("with_trace", True, reason="trace features need cuda target rows "
                        "(the targets here are trace rows themselves)")
    table.X = pd.concat([table.X, trace_columns(table, df)], axis=1)
    return table


def build_table_for(df: pd.DataFrame, sources: tuple[str, ...], base_fn: BaseFn | None,
                    with_trace: bool = False, targets: tuple[str, ...] | None = None
                    ) -> FeatureTable:
    """Features of the rows of `sources` that measured `targets` (plus the trace tier's peaks
    if asked)."""
    from hybridmem.learned.features import build_table

    table = build_table(dataset.usable_rows(df, sources, targets), base_fn)
    return _with_trace(table, df) if with_trace else table


def build_oom_table(df: pd.DataFrame, sources: tuple[str, ...], base_fn: BaseFn | None,
                    with_trace: bool = False) -> FeatureTable | None:
    """Features of the OOM rows of `sources`, or None when there are none (or none has a base)."""
    from hybridmem.learned.features import build_table

    rows = dataset.oom_rows(df, sources)
    if rows.empty:
        return None
    try:
        table = build_table(rows, base_fn)
    except SpecError:
        return None
    return _with_trace(table, df) if with_trace else table
