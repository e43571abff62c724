"""Parent side of a measurement: one child process per config, with a timeout, never trusted.

The child reports through a JSON file it writes atomically; anything else (a signal, a non-zero
exit without a result, a timeout) becomes an `error` result naming what happened, and the sweep
goes on. The child runs in its own session so that a timeout kills its whole process group.

A multi-rank spec (a data-parallel strategy) runs the same child on every rank through torchrun
(`hybridmem.harness.ranks.torchrun_command`); the ranks' results are merged into one
(`hybridmem.harness.ranks.merge`), with the same timeout and failure handling.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from hybridmem.harness import ranks

ENV_TIMEOUT_S = 300.0  # environment query: imports torch and initialises CUDA once
CHILD = "hybridmem.harness.child"
TERM_GRACE_S = 45.0
"""How long a torchrun told to stop (SIGTERM) may take: it stops its ranks with SIGTERM and
kills them after 30 s (`PContext.close(timeout=30)`, torch.distributed.elastic), plus margin."""


def _child_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", CHILD, *args]


def ranks_of(request: dict) -> int | None:
    """Ranks to launch through torchrun for `request`, or None for a plain single process."""
    ps = request.get("spec", {}).get("parallel") or {}
    if ps.get("strategy", "none") == "none" and ps.get("world_size", 1) == 1:
        return None
    return int(ps.get("world_size", 1))


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])[-500:]


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code} without a result"


def _stop(proc: subprocess.Popen, result_path: Path, nproc: int | None) -> int:
    """Kill the child's process group; for torchrun, its ranks too (each in its own session)."""
    if nproc is None:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()
    os.killpg(proc.pid, signal.SIGTERM)  # torchrun forwards it to the ranks and waits for them
    try:
        return proc.wait(timeout=TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    os.killpg(proc.pid, signal.SIGKILL)
    for pid_file in result_path.parent.glob(f"{result_path.name}.rank*.pid"):
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass  # already gone
    return proc.wait()


def _launch_failure(code: int, log_path: Path) -> str | None:
    """Why torchrun failed, naming the first failed rank when its report says which."""
    if code == 0:
        return None
    try:
        cause = ranks.root_cause(log_path.read_text(errors="replace"))
    except OSError:
        cause = None
    if cause:
        return f"rank {cause[0]} died: {_describe_exit(cause[1])}"
    tail = _tail(log_path)
    return f"torchrun failed: {_describe_exit(code)}{'; ' + tail if tail else ''}"


def run_child(args: list[str], result_path: Path, log_path: Path, timeout_s: float,
              nproc: int | None = None) -> dict:
    """Run the child with `args` (on `nproc` ranks through torchrun if given); its JSON result,
    or an `error` result saying why there is none."""
    cmd = (_child_cmd(*args) if nproc is None
           else ranks.torchrun_command(CHILD, nproc, args))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
            why = None
        except subprocess.TimeoutExpired:
            why = f"timed out after {timeout_s:g} s"
        except BaseException:  # Ctrl-C or a kill of the parent: take the child down too
            _stop(proc, result_path, nproc)
            raise
        if why:
            code = _stop(proc, result_path, nproc)
    if nproc is not None:
        failure = why or _launch_failure(code, log_path)
        return ranks.merge(ranks.read(result_path, nproc), failure)
    if why is None and result_path.exists():
        with open(result_path) as fh:
            return json.load(fh)
    why = why or f"child died: {_describe_exit(code)}"
    tail = _tail(log_path)
    return {"outcome": "error", "error": f"{why}{'; ' + tail if tail else ''}"}


def measure(request: dict, timeout_s: float, log_dir: Path | None = None) -> dict:
    """Measure one config (the request the child reads) in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="hybridmem-collect-") as tmp:
        tmp = Path(tmp)
        req, res = tmp / "request.json", tmp / "result.json"
        req.write_text(json.dumps(request))
        log = tmp / "child.log"
        result = run_child([str(req), str(res)], res, log, timeout_s, ranks_of(request))
        if result["outcome"] == "error" and log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            name = f"{request.get('spec_hash', 'unknown')[:16]}.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            (log_dir / name).write_text(text + "\n" + result.get("traceback", ""))
        return result


def query_environment(timeout_s: float = ENV_TIMEOUT_S) -> dict:
    """The probe's environment (GPU name, memory, driver, CUDA), read in a throwaway child."""
    with tempfile.TemporaryDirectory(prefix="hybridmem-env-") as tmp:
        res = Path(tmp) / "env.json"
        out = run_child(["--env", str(res)], res, Path(tmp) / "env.log", timeout_s)
    if out.get("outcome") == "error":
        from hybridmem.errors import SpecError

        raise SpecError("backend", "cuda", reason=f"cannot read the GPU environment: {out['error']}")
    return out
