"""Multi-rank launch for `hybridmem collect`: a torchrun command line and per-rank JSON results.

Each rank of the launched script writes its own result (peaks, outcome) to
`$HYBRIDMEM_RANK_OUT/rank<RANK>.json`; `launch_ranks` runs torchrun in a fresh process group,
waits, and returns the per-rank results in rank order. The same path runs a CPU/gloo stand-in
here and NCCL on a multi-GPU machine; only the script's backend differs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hybridmem.errors import SpecError

RANK_OUT_ENV = "HYBRIDMEM_RANK_OUT"


def torchrun_command(script: str | os.PathLike, nproc: int, args: list[str] | tuple[str, ...] = (),
                     *, nnodes: int = 1, python: str | None = None,
                     module: bool = False) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node N [-m] script args...`.

    `--standalone` starts a local rendezvous on a free port (torchrun docs, single-node), so
    parallel launches do not collide on MASTER_PORT. With `module`, `script` is a module name
    (torchrun `-m`), e.g. the harness child `hybridmem.harness.child`.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise SpecError("nproc", nproc, reason="must be a positive integer")
    if nnodes != 1:
        raise SpecError("nnodes", nnodes, [1], reason="multi-node launches are not supported yet")
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *(["-m"] if module else []), str(script),
            *map(str, args)]


def read_rank_results(out_dir: str | os.PathLike, nproc: int) -> list[dict]:
    """Per-rank JSON results, rank 0 first; a missing rank is an error naming it."""
    results = []
    for rank in range(nproc):
        path = Path(out_dir) / f"rank{rank}.json"
        if not path.exists():
            raise RuntimeError(f"rank {rank} wrote no result ({path})")
        results.append(json.loads(path.read_text()))
    return results


def launch_ranks(script: str | os.PathLike, nproc: int, args: list[str] | tuple[str, ...] = (),
                 *, timeout_s: float = 600, env: dict | None = None) -> list[dict]:
    """Run `script` on `nproc` ranks through torchrun and return each rank's JSON result.

    Raises RuntimeError with the tail of torchrun's output when a rank fails or times out.
    """
    with tempfile.TemporaryDirectory(prefix="hybridmem-ranks-") as out_dir:
        run_env = {**os.environ, **(env or {}), RANK_OUT_ENV: out_dir,
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        try:
            proc = subprocess.run(torchrun_command(script, nproc, args), env=run_env,
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"torchrun timed out after {timeout_s:g} s") from err
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr)[-2000:]
            raise RuntimeError(f"torchrun exited {proc.returncode}:\n{tail}")
        return read_rank_results(out_dir, nproc)


def write_rank_result(result: dict) -> Path:
    """For the launched script: write this rank's result where `launch_ranks` looks for it."""
    out = Path(os.environ[RANK_OUT_ENV]) / f"rank{int(os.environ.get('RANK', 0))}.json"
    out.write_text(json.dumps(result))
    return out


def rank_path(path: str | os.PathLike) -> Path:
    """This rank's own copy of a result path (`RESULT.json.rank3`) when launched by torchrun
    (which sets LOCAL_RANK), else the path itself: ranks must not overwrite each other."""
    if "LOCAL_RANK" not in os.environ:
        return Path(path)
    return Path(f"{path}.rank{int(os.environ.get('RANK', 0))}")


def summarize_ranks(results: list[dict]) -> dict:
    """One row for a multi-rank run: every rank's result, and the maximum over ranks of each
    numeric field all ranks report (the rank that OOMs first decides the job)."""
    shared = set.intersection(*(set(r) for r in results)) if results else set()
    out: dict = {"world_size": len(results), "per_rank": results}
    for key in sorted(shared):
        values = [r[key] for r in results]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = max(values)
    return out
