"""`collect`: run a sweep through a backend and grow the dataset, resumably, within a budget.

Pure orchestration, no printing: the CLI passes a callback for progress. Each finished config
is written as its own part file before the next starts, so a killed run loses at most the
config in flight; `resume=True` skips specs the dataset already holds for this environment.
"""

from __future__ import annotations

import contextlib
import json
import platform
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hybridmem.job.recorded import recorded_values
from hybridmem.allocator.config import alloc_conf_string
from hybridmem.errors import SpecError
from hybridmem.harness import runner, store, tiers
from hybridmem.harness.image_columns import image_columns
from hybridmem.harness.schema import HARNESS_VERSION, OUTCOMES, SCHEMA_VERSION
from hybridmem.harness.sweep import Sweep, SweepItem, load_sweep

BACKENDS: tuple[str, ...] = ("cuda", "trace")
DEFAULT_OUT = {"cuda": Path("datasets") / "cuda", "trace": Path("datasets") / "trace"}
"""Where rows go without `--out`: measurements and tier predictions never share a folder."""


@dataclass
class CollectReport:
    sweep: Sweep
    out: Path
    backend: str
    source: str
    planned: int
    skipped: int
    counts: Counter = field(default_factory=Counter)
    rows: list[dict] = field(default_factory=list)
    stopped_by_budget: bool = False
    too_many_ranks: int = 0
    """Configs not run: they need more GPUs than this machine has (not recorded, not skipped)."""
    wall_seconds: float = 0.0
    nodes: Counter = field(default_factory=Counter)
    """Rows per worker host (`collect --ray`); empty for a local run."""

    def summary(self) -> dict:
        return {"sweep": self.sweep.name, "backend": self.backend, "source": self.source,
                "out": str(self.out), "planned": self.planned, "skipped": self.skipped,
                "measured": len(self.rows), "outcomes": dict(self.counts),
                "stopped_by_budget": self.stopped_by_budget, "wall_seconds": self.wall_seconds,
                "too_many_ranks": self.too_many_ranks,
                "dropped_combinations": self.sweep.dropped}


def software_environment() -> dict:
    import torch
    import transformers

    return {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "alloc_conf": alloc_conf_string(), "hostname": platform.node()}


def _probe():
    """The device probe, checked: SpecError (exit 2) when its device is missing."""
    from hybridmem.harness.probe import load_probe

    probe = load_probe()
    ok, why = probe.available()
    if not ok:
        raise SpecError("backend", "cuda", ("trace",), reason=why)
    return probe


def environment(backend: str) -> tuple[str, dict]:
    """(source, environment columns) for `backend`."""
    env = software_environment()
    if backend == "trace":
        return tiers.METHOD, {**env, "gpu_name": "cpu-trace", "gpu_memory_bytes": 0,
                              "driver_version": "", "cuda_version": ""}
    return _probe().source, {**env, **runner.query_environment()}


def spec_columns(item: SweepItem) -> dict:
    spec = item.spec
    return {
        "spec_hash": item.spec_hash, "spec_json": json.dumps(spec.to_dict(), sort_keys=True),
        "model_config": item.config_json(), "model_name": item.label,
        "model_type": item.config["model_type"], "micro_batch": spec.micro_batch,
        "seq_len": spec.seq_len, "images_per_sample": spec.images_per_sample or 0,
        **image_columns(spec.image_size), "image_tokens": item.image_tokens,
        "precision": spec.precision, "optimizer": spec.optimizer, "train": spec.train,
        "attn": spec.attn, "grad_ckpt": spec.grad_ckpt,
        "lora_r": spec.lora.r if spec.lora else 0, "world_size": spec.parallel.world_size,
        "strategy": spec.parallel.strategy, **recorded_values(spec),
    }


MEASURED = ("params_total", "params_trainable", "param_bytes", "optimizer_state_bytes",
            "peak_allocated_bytes", "peak_reserved_bytes",
            "peak_active_bytes", "peak_inactive_split_bytes", "peak_device_bytes",
            "device_baseline_bytes", "context_bytes", "device_source", "peak_phase",
            "peak_iteration", "num_alloc_retries", "num_ooms", "oom_phase")
TARGETS = ("peak_allocated_bytes", "peak_reserved_bytes", "peak_active_bytes",
           "peak_inactive_split_bytes", "peak_device_bytes", "context_bytes")
"""Null unless the run finished (`ok`): an OOM or a crash has no peak (schema contract)."""
ENVIRONMENT = ("gpu_name", "gpu_memory_bytes", "driver_version", "cuda_version", "torch_version",
               "transformers_version", "alloc_conf", "hostname")


def make_row(item: SweepItem, result: dict, env: dict, source: str, sweep: Sweep,
             wall: float, history: str = "") -> dict:
    times = result.get("iteration_seconds") or []
    steady = times[1:] or times  # iteration 0 pays for lazy optimizer state and kernel choice
    row = {"schema_version": SCHEMA_VERSION, "harness_version": HARNESS_VERSION,
           "collected_at": store.utc_now(), "source": source, "outcome": result["outcome"],
           "error": result.get("error", ""), "sweep_name": sweep.name,
           **spec_columns(item), "iterations": sweep.iterations,
           "step_seconds": statistics.fmean(steady) if steady else None, "wall_seconds": wall,
           "phase_peaks_json": json.dumps(result.get("phases", [])),
           "rank_peaks_json": json.dumps(result["rank_peaks"]) if "rank_peaks" in result else "",
           "history_path": history}
    row.update({k: result.get(k) for k in MEASURED})
    row.update({k: result.get(k) or env.get(k) for k in ENVIRONMENT})
    if row["outcome"] != "ok":
        row.update(dict.fromkeys(TARGETS))
    return row


def run_config(item: SweepItem, backend: str, sweep: Sweep, out: Path,
               record_history: bool) -> tuple[dict, str]:
    """One config's result (a fresh child process, torchrun for ranks) and its history path."""
    if backend == "trace":
        return tiers.estimate(item.runnable_spec()), ""
    history = ""
    request = {"spec": item.runnable_spec().to_dict(), "iterations": sweep.iterations,
               "spec_hash": item.spec_hash}
    if record_history:
        history = f"history/{item.spec_hash[:16]}-{store.utc_now()[:19].replace(':', '')}.pickle"
        (out / "history").mkdir(parents=True, exist_ok=True)
        request["history_path"] = str((out / history).resolve())
    result = runner.measure(request, sweep.timeout_s, log_dir=out / "logs")
    # a multi-rank config leaves one snapshot per rank: HISTORY.rank<R>
    if history and not ((out / history).exists() or any((out / "history").glob(
            f"{Path(history).name}.rank*"))):
        history = ""
    return result, history


def task_environment(backend: str, result: dict) -> tuple[str, dict]:
    """(source, environment columns) of the machine `result` was just made on (a `collect
    --ray` task): a child that got to its device reported the GPU's columns itself, so the
    GPU is queried only when it died first."""
    if backend == "cuda" and result.get("gpu_name"):
        from hybridmem.harness.probe import load_probe

        device = {k: result.get(k) for k in ("gpu_name", "gpu_memory_bytes", "driver_version",
                                             "cuda_version")}
        return load_probe().source, {**software_environment(), **device}
    return environment(backend)


@contextlib.contextmanager
def tracking_run(name: str, enabled: bool):
    """An MLflow run; if the tracking store refuses to open, a warning and a no-op run, so a
    tracking problem never costs a measurement run."""
    from hybridmem.tracking import start_run

    stack = contextlib.ExitStack()
    try:
        run = stack.enter_context(start_run("collect", run_name=name, enabled=enabled))
    except Exception as err:  # MLflow raises its own exception types
        warnings.warn(f"MLflow tracking disabled for this run: {str(err)[:200]}", stacklevel=3)
        run = stack.enter_context(start_run("collect", enabled=False))
    with stack:
        yield run


def collect(sweep_path: str | Path, out: str | Path | None = None, backend: str = "cuda",
            resume: bool = False, max_minutes: float | None = None, record_history: bool = False,
            on_start: Callable[[CollectReport], None] | None = None,
            on_row: Callable[[SweepItem, dict], None] | None = None,
            on_item: Callable[[SweepItem], None] | None = None,
            mlflow: bool = True) -> CollectReport:
    """Run the sweep at `sweep_path` through `backend`, appending one row per config to `out`."""
    if backend not in BACKENDS:
        raise SpecError("backend", backend, BACKENDS)
    if max_minutes is not None and max_minutes <= 0:
        raise SpecError("max_minutes", max_minutes, reason="must be > 0")
    if backend == "cuda":
        _probe()  # fail fast, before the sweep is expanded
    sweep = load_sweep(sweep_path)
    source, env = environment(backend)
    out = Path(out) if out is not None else DEFAULT_OUT[backend]
    done = store.measured_keys(out) if resume else set()
    key = (env["gpu_name"], env["torch_version"], source)
    todo = [it for it in sweep.items if (it.spec_hash, *key) not in done]
    skipped = len(sweep.items) - len(todo)
    gpus = env.pop("device_count", None) if backend == "cuda" else None
    runnable = [it for it in todo if gpus is None or it.spec.parallel.world_size <= gpus]
    if todo and not runnable:  # nothing this machine can launch: say why, in one line
        from hybridmem.harness.ranks import check_gpus

        check_gpus(todo[0].spec.parallel, gpus)
    report = CollectReport(sweep=sweep, out=out, backend=backend, source=source,
                           planned=len(sweep.items), skipped=skipped,
                           too_many_ranks=len(todo) - len(runnable))
    todo = runnable
    budget = max_minutes if max_minutes is not None else sweep.max_minutes
    start = time.monotonic()
    if on_start:
        on_start(report)
    with tracking_run(f"{sweep.name}-{backend}", mlflow) as run:
        run.params({"sweep": sweep.name, "backend": backend, "source": source, "out": out,
                    "resume": resume, "max_minutes": budget, "planned": report.planned,
                    "skipped": report.skipped, "harness_version": HARNESS_VERSION, **env})
        run.artifact(sweep.path)
        for item in todo:
            if budget is not None and time.monotonic() - start > budget * 60:
                report.stopped_by_budget = True
                break
            if on_item:
                on_item(item)
            t0 = time.monotonic()
            result, history = run_config(item, backend, sweep, out, record_history)
            row = make_row(item, result, env, source, sweep, time.monotonic() - t0, history)
            store.append_rows(out, [row])
            report.rows.append(row)
            report.counts[row["outcome"]] += 1
            if on_row:
                on_row(item, row)
        report.wall_seconds = time.monotonic() - start
        store.compact(out)
        run.metrics({"planned": report.planned, "skipped": report.skipped,
                     "measured": len(report.rows), "wall_seconds": report.wall_seconds,
                     **{f"n_{k}": report.counts.get(k, 0) for k in OUTCOMES}})
        run.json_artifact(report.summary(), "summary.json")
    return report
