"""`hybridmem evaluate --holdout torch|source`: every tier on rows the residual never saw.

`torch`: forward in time. Each later torch major.minor is held out in turn; the residual is
trained on the strictly older versions only (`evaluate.forward_splits`), as it would have been
when that version came out. `source`: each source of rows (a published benchmark, our own
collects) is held out and the residual is trained on the others (another GPU, another era).

Tiers, per job group (`adapters.GROUPS`) and figure (device / reserved peak):
- analytic, trace: the base tiers (no training; trace answers from the `tier_rows` cache);
- residual: the split's residual applied to every row it has a figure for (what the trees do
  on their own, domain and trust ignored);
- hybrid: what `predict --method hybrid` answers with the split's model: the residual where
  the model's own evidence (on its training rows only) trusts it for the job's group and the
  job is of a kind its rows had, else the analytic tier (`train.fit_residuals`, `trust`).
Metrics: MAPE, P95 absolute error, under-prediction share, and the coverage of the stated
upper bound (residual and hybrid rows that have one). One MLflow run per held-out split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from hybridmem.errors import SpecError
from hybridmem.learned import dataset
from hybridmem.learned.dataset import TARGET_COLUMNS
from hybridmem.learned.evaluate import forward_splits
from hybridmem.learned.features import BaseFn, FeatureTable, major_minor

HOLDOUTS: tuple[str, ...] = ("torch", "source")
TIERS: tuple[str, ...] = ("analytic", "trace", "residual", "hybrid")
METRICS: tuple[str, ...] = ("n", "mape", "p95_ape", "under_share", "bound_coverage", "n_bound")


@dataclass
class Split:
    name: str
    """What is held out: "torch 2.9", "source qwen-profiling"."""
    train: np.ndarray
    test: np.ndarray
    """Masks over the evaluated rows."""
    trained_on: str


@dataclass
class Holdout:
    by: str
    table: pd.DataFrame
    """One line per (split, figure, tier, group) with `METRICS`; group "all" over every row."""
    errors: pd.DataFrame
    """One line per (split, dataset row, figure, tier): measured, predicted, bound, error_pct."""
    splits: list[Split] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    run_ids: list[str] = field(default_factory=list)


def origin(rows: pd.DataFrame) -> np.ndarray:
    """Where each row comes from: a published row's benchmark (`sweep_name`, the importer's
    adapter name), else its `source` (our cuda collects)."""
    sweep = rows["sweep_name"].fillna("").astype(str) if "sweep_name" in rows else \
        pd.Series([""] * len(rows), index=rows.index)
    src = rows["source"].astype(str)
    return np.where((src == "published") & (sweep != ""), sweep, src)


def make_splits(rows: pd.DataFrame, by: str) -> list[Split]:
    """The held-out splits of `rows` (see the module doc)."""
    if by == "torch":
        versions = rows["torch_version"].tolist()
        out = []
        for held, train, test in forward_splits(versions):
            older = sorted({major_minor(v) for v, t in zip(versions, train) if t},
                           key=lambda v: tuple(int(p) for p in v.split(".")))
            out.append(Split(f"torch {held}", train, test, ", ".join(older)))
        return out
    if by == "source":
        where = origin(rows)
        names = sorted(set(where))
        return [Split(f"source {n}", where != n, where == n,
                      ", ".join(m for m in names if m != n)) for n in names if len(names) >= 2]
    raise SpecError("holdout", by, HOLDOUTS)


def subset(table: FeatureTable, mask: np.ndarray) -> FeatureTable:
    """The rows of `table` picked by `mask` (its CV groups recomputed from them)."""
    return FeatureTable(X=table.X[mask].reset_index(drop=True),
                        rows=table.rows[mask].reset_index(drop=True),
                        base_device=table.base_device[mask], base_reserved=table.base_reserved[mask])


def _measured(rows: pd.DataFrame, target: str) -> np.ndarray:
    return (pd.to_numeric(rows[TARGET_COLUMNS[target]], errors="coerce") > 0).fillna(False).to_numpy()


def fit_split(full: FeatureTable, train_ids: set[int], df: pd.DataFrame, n_splits: int,
              estimator_params: dict | None):
    """`train.fit_residuals` on the split's training rows, per target they measured; None when
    no training row has an analytic base."""
    from hybridmem.learned.train import fit_residuals

    in_train = full.rows["_row"].isin(train_ids).to_numpy()
    tables = {}
    for t in TARGET_COLUMNS:
        mask = in_train & _measured(full.rows, t)
        if mask.any():
            tables[t] = subset(full, mask)
    if not tables:
        return None
    return fit_residuals(tables, df, n_splits, estimator_params)


def residual_answers(fitted, table: FeatureTable, policy: bool) -> dict[str, np.ndarray]:
    """Device / reserved peaks (and bounds) of the rows of `table` from `fitted` models: every
    trained residual (`policy=False`), or only where `predict` would apply it (`policy=True`:
    the job inside the target's domain and its group trusted)."""
    from hybridmem.learned.trust import answer, decision, outside_domain
    from hybridmem.learned.conformal import feature_groups

    n = len(table.rows)
    groups = feature_groups(table.X)
    model_types = (table.rows["model_type"].fillna("").astype(str).to_numpy()
                   if "model_type" in table.rows else np.array([""] * n))
    use = {}
    for t in fitted.estimators:
        if not policy:
            use[t] = np.ones(n, bool)
            continue
        dom = fitted.domains.get(t) or {}
        ok = []
        for i in range(n):
            x = table.X.iloc[i]
            fields = {f: x.get(f) for f in ("train", "precision", "optimizer", "strategy", "loop")}
            fields["model_type"] = model_types[i] or None
            ok.append(not outside_domain(fields, dom)
                      and decision(fitted.trust, t, str(groups[i]))["apply"])
        use[t] = np.array(ok, bool)
    return answer(fitted.estimators, use, table.X, table.base_device, table.base_reserved)


def _lines(split: str, rows: pd.DataFrame, groups: list[str], tier: str,
           figures: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[pd.DataFrame]:
    """Error lines of one tier: `figures` figure -> (predicted, bound) aligned with `rows`."""
    out = []
    for figure, (pred, bound) in figures.items():
        measured = pd.to_numeric(rows[TARGET_COLUMNS[figure]], errors="coerce").to_numpy(float)
        keep = measured > 0
        if not keep.any():
            continue
        p = np.asarray(pred, float)
        with np.errstate(invalid="ignore", divide="ignore"):
            err = (p - measured) / measured * 100
        out.append(pd.DataFrame({
            "split": split, "tier": tier, "figure": figure, "group": np.asarray(groups)[keep],
            "_row": rows["_row"].to_numpy()[keep], "torch": rows["torch_version"].to_numpy()[keep],
            "measured": measured[keep], "predicted": p[keep],
            "bound": np.asarray(bound, float)[keep], "error_pct": err[keep]}))
    return out


def summarise(errors: pd.DataFrame) -> pd.DataFrame:
    """`METRICS` per (split, figure, tier, group), group "all" first."""
    from hybridmem.adapters import GROUPS

    lines = []
    for (split, figure, tier), part in errors.groupby(["split", "figure", "tier"], sort=False):
        present = [g for g in (*GROUPS, "unreadable") if g in set(part["group"])]
        for group in ("all", *present):
            sel = part if group == "all" else part[part["group"] == group]
            sel = sel[np.isfinite(sel["error_pct"])]
            if sel.empty:
                continue
            a = sel["error_pct"].abs().to_numpy()
            bounded = sel[np.isfinite(sel["bound"])]
            lines.append({
                "split": split, "figure": figure, "tier": tier, "group": group, "n": len(sel),
                "mape": float(a.mean()), "p95_ape": float(np.percentile(a, 95)),
                "under_share": float(np.mean(sel["error_pct"] < 0)),
                "bound_coverage": (float(np.mean(bounded["measured"] <= bounded["bound"]))
                                   if len(bounded) else float("nan")),
                "n_bound": len(bounded)})
    return pd.DataFrame(lines, columns=["split", "figure", "tier", "group", *METRICS])


def holdout(data: str | Path, by: str = "torch", *, tiers: tuple[str, ...] = ("analytic", "trace"),
            n_splits: int = 5, base_fn: BaseFn | None = None, use_cache: bool = True,
            estimator_params: dict | None = None, track: bool = True, progress=None) -> Holdout:
    """Every split of `make_splits(by)`: fit on its training rows, answer its held-out rows."""
    from hybridmem.learned.accuracy import UPPER_BOUND_NEEDS, length_kinds, row_groups
    from hybridmem.learned.features import build_table
    from hybridmem.learned.tier_rows import nan_rows, tier_rows
    from hybridmem.learned.train import is_calibrated, pick_sources

    if by not in HOLDOUTS:
        raise SpecError("holdout", by, HOLDOUTS)
    for tier in tiers:
        if tier not in ("analytic", "trace"):
            raise SpecError("tiers", tier, ("analytic", "trace"))
    df = dataset.load(data)
    df = df.assign(_row=np.arange(len(df)))
    sources = pick_sources(df)
    rows = df[df["source"].isin(sources) & (df["outcome"] == "ok")].reset_index(drop=True)
    measured = np.zeros(len(rows), bool)
    for t in TARGET_COLUMNS:
        measured |= _measured(rows, t)
    rows = rows[measured].reset_index(drop=True)
    if rows.empty:
        raise SpecError("data", str(data), reason=f"no ok row with a measured peak among {list(sources)}")
    splits = make_splits(rows, by)
    notes = [] if is_calibrated(sources) else [
        f"rows are {'/'.join(sources)} output, not real GPU measurements"]
    if not splits:
        what = "torch version" if by == "torch" else "source"
        raise SpecError("holdout", by, reason=f"the rows have one {what} only; nothing to hold out")
    groups = row_groups(rows)
    n_upper = sum(k == "upper-bound" for k in length_kinds(rows))
    if n_upper:
        notes.append(f"{n_upper} row(s) are upper-bound lengths, pooled here with exact ones "
                     "(the by-group tables without --holdout report them apart): "
                     + UPPER_BOUND_NEEDS.split(": ", 1)[1])
    try:
        full = build_table(rows, base_fn)
    except SpecError as err:  # no row has an analytic base: base tiers only where they price
        full, notes = None, notes + [f"no analytic base for any row ({err.reason})"]
    if full is not None and full.dropped:
        notes.append(f"{len(full.dropped)} spec(s) have no analytic base (no analytic, residual "
                     f"or hybrid answer for them), e.g. {next(iter(full.dropped.values()))}")
    priced = {}
    if "trace" in tiers:
        tested = np.zeros(len(rows), bool)
        for s in splits:
            tested |= s.test
        trace = nan_rows(len(rows))
        trace.loc[tested] = tier_rows(rows[tested], "trace", use_cache=use_cache,
                                      progress=progress).set_index(np.flatnonzero(tested))
        priced["trace"] = trace
    lines = []
    for s in splits:
        got, more = split_lines(s, rows, groups, full, df, priced, tiers, n_splits,
                                estimator_params)
        lines += got
        notes += more
    errors = pd.concat(lines, ignore_index=True) if lines else pd.DataFrame(
        columns=["split", "tier", "figure", "group", "_row", "torch", "measured", "predicted",
                 "bound", "error_pct"])
    table = summarise(errors)
    result = Holdout(by=by, table=table, errors=errors, splits=splits, notes=notes)
    result.run_ids = log_runs(result, str(data), track)
    return result


def split_lines(s: Split, rows, groups, full, df, priced, tiers, n_splits, estimator_params
                ) -> tuple[list[pd.DataFrame], list[str]]:
    """Error lines of every tier on the held-out rows of split `s`, and notes on what is
    missing."""
    test_rows = rows[s.test]
    test_groups = [g for g, t in zip(groups, s.test) if t]
    out = []
    if "trace" in priced:
        tr = priced["trace"][s.test]
        out += _lines(s.name, test_rows, test_groups, "trace",
                      {f: (tr[f].to_numpy(float), np.full(len(tr), np.nan)) for f in TARGET_COLUMNS})
    in_test = (full.rows["_row"].isin(set(test_rows["_row"])).to_numpy() if full is not None
               else np.zeros(0, bool))
    if not in_test.any():
        return out, [f"{s.name}: none of its {len(test_rows)} rows has an analytic base "
                     "(no analytic, residual or hybrid answer)"]
    tb = subset(full, in_test)
    by_row = dict(zip(rows["_row"], groups))
    tb_groups = [by_row[r] for r in tb.rows["_row"]]
    nan = np.full(len(tb.rows), np.nan)
    if "analytic" in tiers:
        out += _lines(s.name, tb.rows, tb_groups, "analytic",
                      {"device": (tb.base_device, nan), "reserved": (tb.base_reserved, nan)})
    fitted = fit_split(full, set(rows.loc[s.train, "_row"]), df, n_splits, estimator_params)
    if fitted is None:
        return out, [f"{s.name}: no training row ({s.trained_on}) has an analytic base, so "
                     "there is no residual (residual and hybrid tiers missing)"]
    raw = residual_answers(fitted, tb, policy=False)
    # the residual tier has a reserved figure only from a reserved residual
    res_reserved = raw["reserved"] if "reserved" in fitted.estimators else nan
    out += _lines(s.name, tb.rows, tb_groups, "residual",
                  {"device": (raw["device"], raw["device_upper"]),
                   "reserved": (res_reserved, raw["reserved_upper"])})
    pol = residual_answers(fitted, tb, policy=True)
    out += _lines(s.name, tb.rows, tb_groups, "hybrid",
                  {"device": (pol["device"], pol["device_upper"]),
                   "reserved": (pol["reserved"], pol["reserved_upper"])})
    return out, []


def cross_validated(rows: pd.DataFrame, df: pd.DataFrame, target: str, n_splits: int = 5,
                    base_fn: BaseFn | None = None, estimator_params: dict | None = None
                    ) -> tuple[pd.DataFrame, list[str]]:
    """What `predict --method hybrid` answers for each row of `rows` (rows of `df`, with
    `_row`) that measured `target`, held out by grouped CV (model shapes, or configurations
    when the target's rows have one model): each fold is answered by the model and the trust
    decisions `train.fit_residuals` makes from every other row. Returns (`_row`, predicted,
    bound) and notes."""
    from sklearn.model_selection import GroupKFold

    from hybridmem.learned.features import build_table

    full = build_table(rows, base_fn)
    tb = subset(full, _measured(full.rows, target))
    groups = tb.groups
    n_groups = len(set(groups))
    if n_groups < 2:
        return (pd.DataFrame(columns=["_row", "predicted", "bound"]),
                [f"hybrid {target}: one {tb.group_kind} only; no held-out answer"])
    parts = []
    splitter = GroupKFold(n_splits=min(n_splits, n_groups))
    for _, test in splitter.split(tb.X, groups=groups):
        test_ids = set(tb.rows["_row"].to_numpy()[test])
        fitted = fit_split(full, set(full.rows["_row"]) - test_ids, df, n_splits, estimator_params)
        part = subset(tb, np.isin(np.arange(len(tb.rows)), test))
        got = residual_answers(fitted, part, policy=True)
        parts.append(pd.DataFrame({"_row": part.rows["_row"].to_numpy(),
                                   "predicted": got[target], "bound": got[f"{target}_upper"]}))
    out = pd.concat(parts, ignore_index=True)
    return out, [f"hybrid {target}: {len(out)} rows held out by {tb.group_kind} "
                 f"({min(n_splits, n_groups)} folds), each answered as predict would (the "
                 "residual where the fold model's evidence trusts it, else analytic)"]


def log_runs(result: Holdout, data: str, track: bool) -> list[str]:
    """One MLflow run per held-out split (experiment "holdout"): metrics
    `{figure}_{tier}_{group}_{metric}`."""
    from hybridmem.tracking import start_run

    ids = []
    for s in result.splits:
        part = result.table[result.table["split"] == s.name]
        with start_run("holdout", run_name=s.name, enabled=track) as run:
            run.params({"data": data, "holdout": result.by, "held_out": s.name,
                        "trained_on": s.trained_on, "train_rows": int(s.train.sum()),
                        "test_rows": int(s.test.sum())})
            for rec in part.to_dict("records"):
                run.metrics({f"{rec['figure']}_{rec['tier']}_{rec['group']}_{k}": rec[k]
                             for k in METRICS if np.isfinite(rec[k])})
            if run.run_id:
                ids.append(run.run_id)
    return ids
