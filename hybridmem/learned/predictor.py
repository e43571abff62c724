"""`predict --method hybrid`: the analytic estimate corrected by the registry's residual model.

The residual changes only what the analytic tier cannot see: the reserved peak (allocator
caching / fragmentation) and the device peak (CUDA context, memory outside PyTorch). Tensor
categories stay as the analytic tier computed them; the corrections go to the breakdown as
  fragmentation = corrected reserved - (tensor + workspace bytes of the base estimate)
  context       = corrected device - corrected reserved
so the breakdown still sums to the device peak and allocated <= reserved <= device holds.

Which residual answers is decided per target and per job group (`trust`): a residual applies
only where the job is of a kind its rows had and its held-out evidence for the job's group
beats the base tier; the notes and `extras["trust"]` say which rule decided and on what
evidence. Where a residual answers, `extras["bound_bytes"]` is the upper bound of the device
peak (per-group conformal, `conformal`) with its held-out coverage (`bound_coverage`), and the
fit verdict uses it (`Prediction.fits`). With no suitable model, or none that applies, the
analytic estimate (with its sourced default overheads) is returned, and the notes say so.
"""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache
from pathlib import Path

from hybridmem.errors import SpecError
from hybridmem.learned import registry
from hybridmem.learned.versions import major_minor
from hybridmem.prediction import Peak, Prediction
from hybridmem.job.spec import TrainingSpec

_DEFAULT_NOTE = ("no trained residual model applies to this job and environment: this is the "
                 "analytic estimate with its default (sourced) overheads for the CUDA context, "
                 "workspaces and fragmentation")


@lru_cache(maxsize=8)
def _load(path: str, stamp: tuple[int, int]) -> registry.LoadedModel:
    """Registry entries are read once per process (find-max-batch calls us O(log B) times)."""
    return registry.load(path)


def load_cached(folder: Path) -> registry.LoadedModel:
    stat = (folder / "metadata.json").stat()
    return _load(str(folder), (stat.st_mtime_ns, stat.st_size))


def fallback(base: Prediction, notes: list[str], extras: dict | None = None) -> Prediction:
    """The analytic estimate, as the analytic tier's answer (its `method`), said so."""
    return dataclasses.replace(base, notes=tuple(base.notes) + tuple(notes) + (_DEFAULT_NOTE,),
                               extras={**base.extras, "residual_model": None, "fallback": "analytic",
                                       "upper_bound_bytes": None, "bound_bytes": None,
                                       "method_reason": "hybrid: no trained residual model "
                                       "applies to this job and environment",
                                       **(extras or {})})


def corrected(base: Prediction, device: float, reserved: float) -> tuple[Peak, dict[str, int]]:
    """Peak and breakdown with corrected device / reserved peaks (split in the module doc)."""
    bd = dict(base.breakdown)
    inside = base.peak.device_bytes - bd["context"] - bd["fragmentation"]
    new_reserved = max(int(round(reserved)), inside, base.peak.allocated_bytes)
    new_device = max(int(round(device)), new_reserved)
    bd["fragmentation"] = new_reserved - inside
    bd["context"] = new_device - new_reserved
    peak = dataclasses.replace(base.peak, reserved_bytes=new_reserved, device_bytes=new_device)
    return peak, bd


def _gpu_key(name: str) -> str:
    return "".join(ch for ch in name.lower().replace("nvidia", "") if ch.isalnum())


def match_gpu(given: str | None, meta: dict) -> tuple[str, str]:
    """(training GPU name to use as the feature, note) for the GPU the user asked about.

    Dataset rows name GPUs as CUDA does ("NVIDIA H100 80GB HBM3"), the catalogue as `h100-80gb`;
    they match when the catalogue name's first token ("h100") is in the CUDA name.
    """
    trained = meta.get("gpu_names") or ["unknown"]
    default = meta.get("default_gpu") or trained[0]
    if given is None:
        return default, f"GPU assumed: {default} (the model's most common training GPU)"
    token = _gpu_key(given.split("-")[0])
    hits = [g for g in trained if _gpu_key(g) == _gpu_key(given) or (token and token in _gpu_key(g))]
    if hits:
        return hits[0], f"GPU: {given} (trained on {hits[0]})"
    return default, (f"GPU {given} is not among the model's training GPUs ({', '.join(trained)}); "
                     f"its residual for {default} is used")


def out_of_range(features: dict, ranges: dict) -> list[str]:
    """'name=value (trained min..max)' for each main feature outside its training range."""
    out = []
    for name, (lo, hi) in ranges.items():
        v = features.get(name)
        if isinstance(v, (int, float)) and not (lo <= v <= hi):
            out.append(f"{name}={v:g} (trained {lo:g}..{hi:g})")
    return out


def _distance(row: dict, other: dict) -> tuple[list[str], float]:
    """The fields of training row `other` that the user's `row` changes ('name old->new'), and
    the sum of |log(new / old)| over the numeric ones (how far the numbers moved)."""
    diffs, size = [], 0.0
    for key, theirs in other.items():
        if key == "label" or key not in row:
            continue
        mine = row[key]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (mine, theirs))
        if numeric and not math.isclose(float(mine), float(theirs), rel_tol=1e-9):
            diffs.append(f"{key} {theirs:g}->{mine:g}")
            if float(mine) > 0 and float(theirs) > 0:
                size += abs(math.log(float(mine) / float(theirs)))
        elif not numeric and str(mine) != str(theirs):
            diffs.append(f"{key} {theirs}->{mine}")
    return diffs, size


def nearest(row: dict, neighbours: list[dict]) -> str | None:
    """How far the user's spec is from the model's training rows: the closest one (fewest
    differing spec fields, then smallest relative numeric change) and what differs."""
    if not neighbours:
        return None
    scored = [(_distance(row, other), other) for other in neighbours]
    (diffs, _), other = min(scored, key=lambda x: (len(x[0][0]), x[0][1]))
    where = f"nearest training row: {other.get('label') or '?'}"
    return where + (": same spec fields" if not diffs else f", {len(diffs)} field(s) differ: "
                    + ", ".join(diffs))


def trace_row(spec: TrainingSpec, base: Prediction, trace_fn=None) -> tuple[dict, list[str]]:
    """Trace-tier features for a model trained with them (seconds of CPU); NaN if it cannot run."""
    from hybridmem.learned.features import TRACE_FEATURES, trace_features

    try:
        if trace_fn is None:  # per rank, as `tier_rows` priced the dataset's trace figures
            from hybridmem.tiers import estimator
            trace_fn = estimator("trace")
        t = trace_fn(spec)
    except (SpecError, ImportError) as err:
        return ({k: float("nan") for k in TRACE_FEATURES},
                [f"trace tier could not run ({err}); the model's trace features are missing"])
    return trace_features(t.peak.allocated_bytes, t.peak.reserved_bytes, t.peak.device_bytes,
                          base.peak.device_bytes), ["trace tier ran for the model's trace features"]


def domain_fields(spec: TrainingSpec, config: dict) -> dict:
    """The job's values of the fields a model's `domain` lists (`train.DOMAIN_FIELDS`)."""
    return {"train": spec.train, "precision": spec.precision, "optimizer": spec.optimizer,
            "strategy": spec.parallel.strategy, "loop": spec.loop,
            "model_type": config.get("model_type")}


def decisions(spec: TrainingSpec, config: dict, meta: dict, targets) -> tuple[str, dict[str, dict]]:
    """(job group, target -> trust decision) for `spec` under the model of `meta`: the stored
    per-group decision (`trust.decision`), or "outside-domain" (with `fields`) when the
    target's rows never had a job of this kind."""
    from hybridmem.adapters import job_group
    from hybridmem.learned.trust import decision, outside_domain

    group = job_group(spec)
    fields = domain_fields(spec, config)
    out = {}
    for t in targets:
        foreign = outside_domain(fields, (meta.get("target_domains") or {}).get(t) or {})
        out[t] = ({"apply": False, "rule": "outside-domain", "evidence": {}, "fields": foreign}
                  if foreign else decision(meta.get("trust"), t, group))
    return group, out


def _trust_notes(group: str, decided: dict[str, dict]) -> list[str]:
    from hybridmem.learned.trust import describe

    return [describe(d, t, group) + (f": {'; '.join(d['fields'])}" if d.get("fields") else "")
            for t, d in decided.items()]


def _torch_note(env: dict, meta: dict, group: str, decided: dict[str, dict]) -> str | None:
    """For a torch outside the trained versions: the stated uncertainty, i.e. how far the
    residual carried to a newer torch in the forward hold-out for this group (if measured)."""
    trained = sorted({major_minor(v) for v in meta.get("torch_versions", []) if major_minor(v)})
    mine = major_minor(env.get("torch"))
    if mine is None or mine in trained:
        return None
    held = [(t, d["evidence"]["torch"]) for t, d in decided.items()
            if d["apply"] and "torch" in (d.get("evidence") or {})]
    text = (f"torch {mine} is not among the trained versions ({', '.join(trained)}): the "
            "torch version is a feature of the residual, not a refusal; ")
    if not held:
        return text + (f"no torch-version hold-out measured how it carries to a newer torch "
                       f"for {group} jobs (the rows span one version)")
    return text + "; ".join(
        f"{t} residual on a later torch before ({'; '.join(s.get('splits', []))}): MAPE "
        f"{s['residual_mape']:.1f} % vs {s['base_mape']:.1f} % for the base tier on "
        f"{s['rows']} rows" for t, s in held)


def _trust_extra(group: str, decided: dict[str, dict]) -> dict:
    return {t: {"group": group, "applied": bool(d["apply"]), "rule": d["rule"],
                "evidence": d.get("evidence") or {}} for t, d in decided.items()}


def gate(spec: TrainingSpec, config: dict, base: Prediction, meta: dict, name: str,
         targets) -> Prediction | None:
    """The analytic fallback (with the rule that decided) when no residual of the model of
    `meta` answers `spec`, else None. Needs the metadata only, so `estimate` decides before
    loading any booster."""
    from hybridmem.learned.trust import outside_domain

    foreign = outside_domain(domain_fields(spec, config), meta.get("domain") or {})
    if foreign:
        return fallback(base, [f"residual model {name} does not apply: it never saw "
                               + "; ".join(foreign)])
    group, decided = decisions(spec, config, meta, targets)
    if not any(d["apply"] for d in decided.values()):
        return fallback(base, [f"residual model {name} does not answer this job"]
                        + _trust_notes(group, decided), {"trust": _trust_extra(group, decided)})
    return None


def apply_model(spec: TrainingSpec, base: Prediction, model: registry.LoadedModel,
                env: dict, gpu_name: str | None = None, trace_fn=None) -> Prediction:
    """The base prediction corrected by `model` where its evidence trusts it, with notes, the
    upper bound and its held-out coverage."""
    import numpy as np
    import pandas as pd

    from hybridmem.learned.features import feature_row
    from hybridmem.learned.trust import answer, coverage_source
    from hybridmem.models.loader import load_config_dict

    meta = model.metadata
    _, config = load_config_dict(spec.model)
    refused = gate(spec, config, base, meta, model.name, tuple(model.estimators))
    if refused is not None:
        return refused
    group, decided = decisions(spec, config, meta, model.estimators)
    trust_extra = _trust_extra(group, decided)
    gpu, gpu_note = match_gpu(gpu_name, meta)
    memory = (meta.get("gpu_memory_by_name") or {}).get(gpu, meta.get("gpu_memory_bytes"))
    row = feature_row(spec, config, base, {
        "gpu_name": gpu, "gpu_memory_bytes": memory or 0,
        "torch_version": env.get("torch") or (meta.get("torch_versions") or [""])[-1],
        "cuda_version": env.get("cuda") or (meta.get("cuda_versions") or [""])[-1]})
    trace_notes: list[str] = []
    if meta.get("trace_features"):
        extra, trace_notes = trace_row(spec, base, trace_fn)
        row.update(extra)
    X = pd.DataFrame([row])
    ests = model.estimators
    use = {t: np.array([bool(d["apply"])]) for t, d in decided.items()}
    got = answer(ests, use, X, np.array([base.peak.device_bytes], float),
                 np.array([base.peak.reserved_bytes], float))
    peak, bd = corrected(base, got["device"][0], got["reserved"][0])
    upper = max(int(round(got["device_upper"][0])), peak.device_bytes)
    bounding = "device" if decided.get("device", {}).get("apply") else "reserved"
    nominal = float(getattr(ests[bounding], "alpha", 0.95))
    coverage = coverage_source(decided[bounding])
    coverage = {**coverage, "nominal": nominal, "target": bounding} if coverage else None
    cov_text = (f"held-out coverage {coverage['coverage']:.0%} by {coverage['source']} on "
                f"{coverage['rows']} rows" if coverage else "no held-out coverage measured")
    notes = [f"residual model {model.name} ({meta.get('dataset', {}).get('rows_used', '?')} rows, "
             f"GPUs {', '.join(meta.get('gpu_names', []))}, torch {', '.join(meta.get('torch_versions', []))})",
             gpu_note,
             "context and fragmentation above are the analytic defaults corrected by this model",
             *_trust_notes(group, decided),
             f"P95 upper bound of the device peak: {upper / 2**30:.2f} GiB (nominal "
             f"{nominal:.0%}, {cov_text}); the fit verdict uses it"]
    if not meta.get("calibrated_to_gpu"):
        notes.insert(0, f"WARNING: model {model.name} was trained on "
                        f"{'/'.join(meta.get('sources', ['?']))} rows, not real GPU measurements; "
                        "it is NOT calibrated to real GPUs")
    if bounding == "reserved":
        why = ("its rows measured no device figure" if "device" not in ests
               else "its device residual does not apply")
        notes.append(f"model {model.name} corrects the reserved peak only ({why}); CUDA context "
                     "and workspaces are the analytic defaults")
    torch_note = _torch_note(env, meta, group, decided)
    if torch_note:
        notes.append(torch_note)
    notes += trace_notes
    outside = out_of_range(row, meta.get("feature_ranges", {}))
    if outside:
        notes.append("spec outside the model's training range: " + "; ".join(outside))
    near = nearest(row, meta.get("neighbours") or [])
    if near:
        notes.append(near)
    return dataclasses.replace(
        base, method="hybrid", peak=peak, breakdown=bd, notes=tuple(base.notes) + tuple(notes),
        extras={**base.extras, "residual_model": model.name, "upper_bound_bytes": upper,
                "bound_bytes": upper, "bound_coverage": coverage, "trust": trust_extra,
                "calibrated_to_gpu": bool(meta.get("calibrated_to_gpu"))})


def default_method(models_dir: str | Path | None = None, spec: TrainingSpec | None = None) -> str:
    """"hybrid" when the registry has a GPU-calibrated model for this environment, else "analytic".

    What `hybridmem predict` uses when `--method` is not given. A torch minor version outside
    the model's training set does not rule it out (the hybrid tier applies each residual only
    to the job groups its held-out evidence trusts it on, and says so). With `spec`, "hybrid"
    only when some residual of that model answers the spec (its domain and group trust).
    Models trained on trace rows never count.
    """
    env = registry.user_env()
    root = Path(models_dir) if models_dir is not None else registry.models_root()
    folder, _ = registry.select(root, env["torch"], env["cuda"])
    if folder is None:
        return "analytic"
    meta = registry.read_metadata(folder)
    if not meta.get("calibrated_to_gpu"):
        return "analytic"
    if spec is None:
        return "hybrid"
    from hybridmem.learned.trust import outside_domain
    from hybridmem.models.loader import load_config_dict

    _, config = load_config_dict(spec.model)
    if outside_domain(domain_fields(spec, config), meta.get("domain") or {}):
        return "analytic"
    _, decided = decisions(spec, config, meta, meta.get("targets", registry.TARGETS))
    return "hybrid" if any(d["apply"] for d in decided.values()) else "analytic"


def estimate(spec: TrainingSpec, *, models_dir: str | Path | None = None,
             gpu_name: str | None = None, base_fn=None, trace_fn=None,
             gpu=None) -> Prediction:
    """Hybrid estimate of `spec`: analytic base + the newest matching residual model.

    The base is `features.analytic_base` (per rank for a multi-GPU spec), the very function the
    training rows were featurised with; `predict.estimator` therefore does not shard this tier's
    answer again (`learned.tier`: `per_rank`)."""
    from hybridmem.learned.features import resolve_base
    from hybridmem.tiers import estimator, refusal
    from hybridmem.families.defaults import as_job

    spec = as_job(spec)  # the hybrid tier's Python entry: a Job as it is

    refused = refusal("analytic", spec) if base_fn is None else None
    if refused is not None:  # no analytic base to correct: the trace tier's answer, said so
        reason = (f"the analytic tier refuses {refused.field}={refused.value!r}: "
                  f"{refused.reason}, so there is no analytic estimate for a residual model "
                  "to correct")
        pred = estimator("trace")(spec, **({"gpu": gpu} if gpu is not None else {}))
        return dataclasses.replace(pred, notes=pred.notes + (
            f"hybrid: {reason}; this is the trace tier's answer",),
            extras={**pred.extras, "residual_model": None, "fallback": "trace",
                    "method_reason": reason})
    base = resolve_base(base_fn)(spec)
    env = registry.user_env()
    root = Path(models_dir) if models_dir is not None else registry.models_root()
    folder, notes = registry.select(root, env["torch"], env["cuda"])
    if folder is None:
        return fallback(base, notes)
    try:
        from hybridmem.models.loader import load_config_dict

        meta = registry.read_metadata(folder)
        refused = gate(spec, load_config_dict(spec.model)[1], base, meta, folder.name,
                       tuple(meta.get("targets", registry.TARGETS)))
        if refused is not None:  # decided from the metadata: no booster is loaded
            return dataclasses.replace(refused, notes=refused.notes + tuple(notes))
        model = load_cached(folder)
    except SpecError as err:  # a damaged entry must not break `predict`; say so and fall back
        return fallback(base, notes + [f"model {folder.name} could not be loaded: {err}"])
    pred = apply_model(spec, base, model, env, gpu_name, trace_fn)
    return dataclasses.replace(pred, notes=pred.notes + tuple(notes))
