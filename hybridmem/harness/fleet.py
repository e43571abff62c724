"""`collect --ray`: a sweep's configs as Ray tasks over a cluster, the driver the only writer.

Each config is one Ray task asking for its GPUs (`num_gpus` = its world size; none for the
trace backend or a CPU stand-in probe). The task runs the local path's step
(`collection.run_config`: a fresh child process per config, torchrun for a multi-rank one, on
one node) and returns the finished row, with the environment columns of the node it ran on.
The driver submits configs in the sweep's order, each once the cluster has GPUs (CPUs) for it
beside those in flight (so the order holds and `--max-minutes` means "start no config after"),
and writes each row as its own part file as it comes back (`ray.wait`). A task Ray could not finish (its worker
or node died more than `MAX_RETRIES` times, or it ran past its timeout) becomes an `error` row,
as a crashed child does locally.

`--resume` skips a spec the dataset holds under any environment of the cluster's nodes (each
node is asked for its environment first), so one sweep over a fleet measures each config once;
rows written before a driver, worker or node was killed are kept, and nothing is written twice.
Ray is imported only here (the `ray` extra); nothing below the harness imports it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from hybridmem.errors import SpecError
from hybridmem.harness import collection, store
from hybridmem.harness.runner import ENV_TIMEOUT_S, TERM_GRACE_S
from hybridmem.harness.schema import HARNESS_VERSION, OUTCOMES
from hybridmem.harness.sweep import Sweep, SweepItem, load_sweep

MAX_RETRIES = 2
"""Reruns of a task whose worker process or node died (Ray's `max_retries`; the config's own
failures are rows, never retried)."""
TASK_SLACK_S = ENV_TIMEOUT_S + TERM_GRACE_S + 60.0
"""A task's time beyond its child's own timeout: the worker may query its GPU's environment
(`ENV_TIMEOUT_S`) and stop a torchrun (`TERM_GRACE_S`); 60 s for the worker's own start and
imports (assumed). The driver counts a task's time from its submission, and a task may first
wait for one running config to free GPUs on a node: its timeout is 2 x `timeout_s` + this."""
POLL_S = 1.0  # how often the driver looks at overdue tasks and the budget while waiting
FORWARDED_PREFIX = "HYBRIDMEM_"
"""The driver's environment variables with this prefix (the probe, the tracking store) are set
in every task, so a worker runs the same probe as the driver asked for."""


def _ray():
    try:
        import ray
    except ImportError:
        raise SpecError("ray", "not installed",
                        reason="install the ray extra: pip install 'hybridmem[ray]'") from None
    return ray


def connect(address: str) -> bool:
    """Join the cluster at `address` (`auto`: the one `ray start` made on this machine;
    `local`: a new one on this machine). True when this call started Ray (so it stops it)."""
    ray = _ray()
    if ray.is_initialized():  # a caller (a test) already holds a cluster
        return False
    import logging

    kwargs = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address == "local":
        ray.init(include_dashboard=False, **kwargs)
    else:
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, ValueError, RuntimeError) as err:
            raise SpecError("ray", address, ("ADDRESS", "auto", "local"),
                            reason=f"cannot join the cluster ({str(err).splitlines()[0][:200]})"
                            ) from None
    return True


def _probe_source(backend: str) -> str:
    """The rows' `source`: the trace tier's, or the probe class's (`cuda`, `dryrun`), read on the
    driver without touching a device (the driver may have no GPU)."""
    if backend == "trace":
        return collection.tiers.METHOD
    from hybridmem.harness.probe import load_probe

    return load_probe().source


def _runtime_env() -> dict | None:
    """The tasks' runtime environment: the driver's forwarded variables, if any (Ray starts
    separate workers for a task with a runtime environment)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIX)}
    return {"env_vars": env} if env else None


def node_environment(backend: str) -> tuple[str, str, dict]:
    """(node id, source, environment columns) of the node this runs on (in a task)."""
    import ray

    source, env = collection.environment(backend)
    env.pop("device_count", None)
    return ray.get_runtime_context().get_node_id(), source, env


def run_task(item: SweepItem, backend: str, sweep: Sweep, out: str,
             record_history: bool) -> dict:
    """One config in a Ray task: the local path's step, then its row."""
    t0 = time.monotonic()
    result, history = collection.run_config(item, backend, sweep, Path(out), record_history)
    source, env = collection.task_environment(backend, result)
    return collection.make_row(item, result, env, source, sweep, time.monotonic() - t0, history)


def _gpu_nodes(ray) -> dict[str, int]:
    """Alive node id -> its GPUs."""
    return {n["NodeID"]: int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"]}


def fleet_environments(ray, backend: str, gpus: bool) -> dict[str, tuple[str, dict]]:
    """Node id -> (source, environment) of every node that can run the sweep's tasks: one
    task pinned to each (one GPU each when the tasks use GPUs)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = {n: g for n, g in _gpu_nodes(ray).items() if g or not gpus}
    task = ray.remote(node_environment)
    refs = [task.options(num_cpus=0, num_gpus=1 if gpus else 0,
                         runtime_env=_runtime_env(),
                         scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)
                         ).remote(backend) for n in nodes]
    try:
        answers = ray.get(refs)
    except Exception as err:  # the task's own error (no device, no hybridmem there) inside Ray's
        raise SpecError("ray", "cluster", reason="a node cannot report its environment: "
                        f"{_first_line(getattr(err, 'cause', None) or err)[:300]}") from None
    return {node: (source, env) for node, source, env in answers}


def failure_row(item: SweepItem, err: str, envs: dict, source: str, sweep: Sweep,
                wall: float) -> dict:
    """The row of a task with no result (which node it died on is unknown). Its environment is
    the cluster's when all nodes share one resume key (GPU, torch; the first node's driver and
    CUDA versions), with no hostname; else empty, so `--resume` runs the config again."""
    keys = {(e["gpu_name"], e["torch_version"], s) for s, e in envs.values()}
    env = ({**next(iter(envs.values()))[1], "hostname": ""} if len(keys) == 1
           else {"gpu_memory_bytes": 0})
    return collection.make_row(item, {"outcome": "error", "error": err[:500]}, env, source,
                               sweep, wall)


def _stop(ray, pending) -> None:
    """Stop the tasks in flight (Ctrl-C, TERM; their rows are lost). A cancel that does not
    force raises KeyboardInterrupt in the task, so the runner kills its child's process group
    before the worker goes (a forced cancel kills the worker and leaves the child running)."""
    for ref in pending:
        ray.cancel(ref)
    if pending:
        ray.wait(list(pending), num_returns=len(pending), timeout=TERM_GRACE_S)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def collect_ray(sweep_path: str | Path, address: str = "local", out: str | Path | None = None,
                backend: str = "cuda", resume: bool = False, max_minutes: float | None = None,
                record_history: bool = False,
                on_start: Callable[[collection.CollectReport], None] | None = None,
                on_row: Callable[[SweepItem, dict], None] | None = None,
                on_item: Callable[[SweepItem], None] | None = None,
                mlflow: bool = True) -> collection.CollectReport:
    """`collection.collect` over the Ray cluster at `address`."""
    if backend not in collection.BACKENDS:
        raise SpecError("backend", backend, collection.BACKENDS)
    if max_minutes is not None and max_minutes <= 0:
        raise SpecError("max_minutes", max_minutes, reason="must be > 0")
    ray = _ray()
    source = _probe_source(backend)
    sweep = load_sweep(sweep_path)
    started = connect(address)
    try:
        return _drive(ray, sweep, address, source, out, backend, resume, max_minutes,
                      record_history, on_start, on_row, on_item, mlflow)
    finally:
        if started:
            ray.shutdown()


def _drive(ray, sweep, address, source, out, backend, resume, max_minutes, record_history,
           on_start, on_row, on_item, mlflow) -> collection.CollectReport:
    gpus = source == "cuda"  # the trace tier and a CPU stand-in probe need no GPU
    node_gpus = _gpu_nodes(ray)
    if gpus and not any(node_gpus.values()):
        raise SpecError("ray", address, reason="the cluster has no GPU (backend cuda)")
    envs = fleet_environments(ray, backend, gpus)
    out = Path(out) if out is not None else collection.DEFAULT_OUT[backend]
    done = store.measured_keys(out) if resume else set()
    keys = {(e["gpu_name"], e["torch_version"], s) for s, e in envs.values()}
    todo = [it for it in sweep.items if not any((it.spec_hash, *k) in done for k in keys)]
    most = max(node_gpus.values()) if gpus else None
    runnable = [it for it in todo if most is None or it.spec.parallel.world_size <= most]
    report = collection.CollectReport(sweep=sweep, out=out, backend=backend, source=source,
                                      planned=len(sweep.items),
                                      skipped=len(sweep.items) - len(todo),
                                      too_many_ranks=len(todo) - len(runnable))
    resources = ray.cluster_resources()
    slots = max(1, int(resources.get("GPU" if gpus else "CPU", 1)))
    budget = max_minutes if max_minutes is not None else sweep.max_minutes
    nodes: Counter = Counter()
    start = time.monotonic()
    if on_start:
        on_start(report)

    def write(item: SweepItem, row: dict) -> None:
        store.append_rows(out, [row])
        report.rows.append(row)
        report.counts[row["outcome"]] += 1
        nodes[row["hostname"] or "unknown"] += 1
        if on_row:
            on_row(item, row)

    queue = _Queue(ray, sweep, envs, source, backend, out, record_history, gpus, slots, write)
    with collection.tracking_run(f"{sweep.name}-{backend}-ray", mlflow) as run:
        run.params({"sweep": sweep.name, "backend": backend, "source": source, "out": out,
                    "resume": resume, "max_minutes": budget, "planned": report.planned,
                    "skipped": report.skipped, "harness_version": HARNESS_VERSION,
                    "ray_address": address, "ray_nodes": len(envs), "ray_slots": slots})
        run.artifact(sweep.path)
        deadline = start + budget * 60 if budget is not None else None
        report.stopped_by_budget = queue.run(runnable, deadline, on_item)
        report.wall_seconds = time.monotonic() - start
        store.compact(out)
        run.metrics({"planned": report.planned, "skipped": report.skipped,
                     "measured": len(report.rows), "wall_seconds": report.wall_seconds,
                     **{f"n_{k}": report.counts.get(k, 0) for k in OUTCOMES},
                     **{f"rows_node.{_metric_name(h)}": n for h, n in nodes.items()}})
        run.json_artifact({**report.summary(), "rows_per_node": dict(nodes)}, "summary.json")
    report.nodes.update(nodes)
    return report


class _Queue:
    """The sweep's configs on the cluster, in run order: each goes out once the cluster has
    room for it (a GPU task asks for its world size, any other for one CPU, Ray's default),
    each row written as its task returns; a task past twice the sweep's time limit (plus
    slack) is cancelled, and so is every pending one when the drive ends."""

    def __init__(self, ray, sweep, envs, source, backend, out, record_history, gpus, slots,
                 write):
        self.ray, self.sweep, self.envs, self.source = ray, sweep, envs, source
        self.gpus, self.slots, self.write = gpus, slots, write
        self.timeout = 2 * sweep.timeout_s + TASK_SLACK_S
        task = ray.remote(run_task)
        options = {"max_retries": MAX_RETRIES, "retry_exceptions": False,
                   "runtime_env": _runtime_env()}
        light = dataclasses.replace(sweep, items=())  # what a task needs of the sweep
        self.submit = lambda item, ranks: task.options(num_gpus=ranks, **options).remote(
            item, backend, light, str(out), record_history)
        self.pending: dict = {}

    def need(self, item: SweepItem) -> int:
        return item.spec.parallel.world_size if self.gpus else 1

    def run(self, items: list[SweepItem], deadline: float | None, on_item) -> bool:
        """Every item priced or failed; True where the budget stopped it early."""
        queue, stopped = list(items), False
        try:
            while queue or self.pending:
                while queue and (not self.pending or sum(p[2] for p in self.pending.values())
                                 + self.need(queue[0]) <= self.slots):
                    if deadline is not None and time.monotonic() > deadline:
                        stopped = True
                        queue.clear()
                        break
                    item = queue.pop(0)
                    if on_item:
                        on_item(item)
                    ref = self.submit(item, item.spec.parallel.world_size if self.gpus else 0)
                    self.pending[ref] = (item, time.monotonic(), self.need(item))
                if not self.pending:
                    break
                self.collect()
        finally:
            _stop(self.ray, self.pending)
        return stopped

    def collect(self) -> None:
        """The rows of the tasks done within one poll; the late tasks cancelled."""
        ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=POLL_S)
        for ref in ready:
            item, t0, _ = self.pending.pop(ref)
            try:
                row = self.ray.get(ref)
            except Exception as err:  # Ray's own errors: worker / node died, cancelled
                row = failure_row(item, f"ray task failed: {_first_line(err)}", self.envs,
                                  self.source, self.sweep, time.monotonic() - t0)
            self.write(item, row)
        now = time.monotonic()
        for ref, (item, t0, _) in list(self.pending.items()):
            if now - t0 > self.timeout:
                self.ray.cancel(ref)
                del self.pending[ref]
                self.write(item, failure_row(item, f"ray task timed out after {self.timeout:g} s",
                                             self.envs, self.source, self.sweep, now - t0))


def _metric_name(host: str) -> str:
    """A hostname as an MLflow metric key (letters, digits, `_-./` and spaces are allowed)."""
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in host)
