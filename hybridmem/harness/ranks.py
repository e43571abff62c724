"""The harness's torchrun protocol: how ranks are launched, where each writes its result, and
one result from them all (the job is as big as its worst rank).

The parent launches the child on N ranks with `torchrun_command`; every rank writes its own
result (`RESULT.json.rank<R>`, `rank_path`). A rank that ran out of memory makes
the job an `oom` (the other ranks' failures follow from it: a peer left the collective); any
other failure, or a rank that wrote nothing, an `error` naming the rank. An `ok` job takes, per
numeric field, the maximum over ranks (`worst_numbers`), the phase
of its allocated peak from the rank that holds it, and keeps every rank's peaks (`rank_peaks`).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from hybridmem.errors import SpecError

RANK_FIELDS = ("outcome", "error", "peak_allocated_bytes", "peak_reserved_bytes",
               "peak_active_bytes", "peak_inactive_split_bytes", "peak_device_bytes",
               "context_bytes", "device_baseline_bytes", "param_bytes", "optimizer_state_bytes",
               "peak_phase", "peak_iteration", "num_alloc_retries", "num_ooms")
"""What `rank_peaks_json` keeps of each rank."""
NO_RESULT = "no-result"
"""Per-rank outcome of a rank that wrote nothing (killed, or stopped by torchrun)."""

# torchrun's failure report (torch/distributed/elastic/multiprocessing/errors): the first
# failed rank under "Root Cause", as "rank : 1 (local_rank: 1)" then "exitcode : -9 (pid: N)"
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def torchrun_command(module: str, nproc: int, args: list[str] | tuple[str, ...] = (),
                     *, python: str | None = None) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node N -m module args...`.

    `--standalone` starts a local rendezvous on a free port (torchrun docs, single-node), so
    parallel launches do not collide on MASTER_PORT; multi-node launches are not supported.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise SpecError("nproc", nproc, reason="must be a positive integer")
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", module, *map(str, args)]


MEASURED_LAYOUTS = "tp (with sequence parallelism), cp, with FSDP2 over dp; pp alone"
"""The model-parallel layouts the harness runs (`distributed.model_parallel`: torchtitan's
plans and torch's pipeline schedules, as the trace tier runs them)."""


def check_measurable(ps, attn: str) -> None:
    """One-line refusal of a model-parallel layout the harness does not run."""
    for name in ("ep", "dp_replicate"):
        if getattr(ps, name) > 1:
            raise SpecError(f"parallel.{name}", getattr(ps, name), (1,),
                            reason=f"the harness measures {MEASURED_LAYOUTS}")
    if ps.pp > 1:  # the trace tier's pipeline ranks: one stage group, no other axis
        for name, size in (("tp", ps.tp), ("cp", ps.cp), ("dp_shard", ps.data_shard)):
            if size > 1:
                raise SpecError(f"parallel.{name}", size, (1,),
                                reason=f"with pp={ps.pp} the harness runs the pipeline "
                                f"alone (it measures {MEASURED_LAYOUTS})")
    if ps.cp > 1 and attn == "eager":
        raise SpecError("attn", attn, ("sdpa", "flash_attention_2"),
                        reason="context parallelism replaces SDPA (torch's ring attention)")


def check_gpus(ps, visible: int | None) -> None:
    """One-line refusal of a layout this machine cannot launch: every rank needs its own GPU,
    dp_replicate x dp_shard x cp x tp x pp of them (`ParallelSpec.world_size`); `visible` None
    means CPU ranks (gloo), which any world size runs."""
    if visible is None or ps.world_size <= visible:
        return
    axes = f"dp {ps.data_parallel} x cp {ps.cp} x tp {ps.tp} x pp {ps.pp}"
    raise SpecError("world_size", ps.world_size, reason=f"the layout ({axes}) needs "
                    f"{ps.world_size} GPUs, one per rank; this machine shows {visible}")


def launched() -> bool:
    """True inside a rank started by torchrun, which sets both variables."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_file(path: str | os.PathLike, rank: int) -> Path:
    """Rank `rank`'s own copy of a per-job path: `RESULT.json.rank3`."""
    return Path(f"{path}.rank{rank}")


def rank_path(path: str | os.PathLike) -> Path:
    """This process's copy of a per-job path: its rank's when launched by torchrun, else the
    path itself (ranks must not overwrite each other's results and snapshots)."""
    return rank_file(path, int(os.environ.get("RANK", 0))) if launched() else Path(path)


def read(result_path: Path, nproc: int) -> list[dict | None]:
    """Each rank's result, rank 0 first; None where a rank wrote nothing."""
    out = []
    for rank in range(nproc):
        path = rank_file(result_path, rank)
        out.append(json.loads(path.read_text()) if path.exists() else None)
    return out


def root_cause(log_text: str) -> tuple[int, int] | None:
    """(rank, exit code) of the first failed rank in torchrun's report, if it printed one."""
    m = _ROOT_CAUSE.search(log_text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def rank_peaks(results: list[dict | None]) -> list[dict]:
    return [{"rank": k, "outcome": NO_RESULT} if r is None
            else {"rank": k, **{f: r.get(f) for f in RANK_FIELDS}}
            for k, r in enumerate(results)]


def worst_numbers(results: list[dict]) -> dict:
    """Per field that every rank reports as a number, the maximum over ranks (the rank that
    runs out first decides the job)."""
    shared = set.intersection(*(set(r) for r in results)) if results else set()
    out = {}
    for key in sorted(shared):
        values = [r[key] for r in results]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = max(values)
    return out


def _first_failure(failed: list[tuple[int, dict]]) -> tuple[int, dict]:
    return min(failed, key=lambda kr: kr[1].get("ended_at") or float("inf"))


def _ok(results: list[dict]) -> dict:
    worst = max(results, key=lambda r: r.get("peak_allocated_bytes") or 0)
    out = {**worst, **worst_numbers(results), "world_size": len(results)}
    # the slowest rank sets the pace of a synchronous step
    times = [r.get("iteration_seconds") or [] for r in results]
    out["iteration_seconds"] = [max(t) for t in zip(*times)]
    out["peak_phase"], out["peak_iteration"] = worst.get("peak_phase"), worst.get("peak_iteration")
    out["phases"] = worst.get("phases", [])
    return out


def merge(results: list[dict | None], failure: str | None = None) -> dict:
    """The job's result from its ranks' results; `failure` says why the launch itself ended
    badly (a timeout, torchrun's exit), None when it exited cleanly."""
    per_rank = rank_peaks(results)
    present = [(k, r) for k, r in enumerate(results) if r is not None]
    failed = [(k, r) for k, r in present if r["outcome"] != "ok"]
    ooms = [(k, r) for k, r in failed if r["outcome"] == "oom"]
    if ooms or failed:
        k, r = _first_failure(ooms or failed)
        out = {**r, "error": f"rank {k}: {r.get('error', '')}"[:500]}
    elif failure or len(present) < len(results):
        missing = [k for k, r in enumerate(results) if r is None]
        why = failure or "torchrun exited cleanly"
        out = {"outcome": "error",
               "error": (f"{why}; no result from rank(s) {missing}" if missing else why)[:500]}
    else:
        out = _ok([r for _, r in present])
    out["rank_peaks"] = per_rank
    return out
