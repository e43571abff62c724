"""One result from the ranks of a multi-rank measurement: the job is as big as its worst rank.

Every rank writes its own result (`RESULT.json.rank<R>`). A rank that ran out of memory makes
the job an `oom` (the other ranks' failures follow from it: a peer left the collective); any
other failure, or a rank that wrote nothing, an `error` naming the rank. An `ok` job takes, per
numeric field, the maximum over ranks (`hybridmem.parallel.launch.summarize_ranks`), the phase
of its allocated peak from the rank that holds it, and keeps every rank's peaks (`rank_peaks`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from hybridmem.parallel.launch import summarize_ranks

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


def read(result_path: Path, nproc: int) -> list[dict | None]:
    """Each rank's result, rank 0 first; None where a rank wrote nothing."""
    out = []
    for rank in range(nproc):
        path = Path(f"{result_path}.rank{rank}")
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


def _first_failure(failed: list[tuple[int, dict]]) -> tuple[int, dict]:
    return min(failed, key=lambda kr: kr[1].get("ended_at") or float("inf"))


def _ok(results: list[dict]) -> dict:
    worst = max(results, key=lambda r: r.get("peak_allocated_bytes") or 0)
    out = {**worst, **summarize_ranks(results)}
    del out["per_rank"]
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
