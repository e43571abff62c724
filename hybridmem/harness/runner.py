"""Parent side of a measurement: one child process per config, with a timeout, never trusted.

The child reports through a JSON file it writes atomically; anything else (a signal, a non-zero
exit without a result, a timeout) becomes an `error` result naming what happened, and the sweep
goes on. The child runs in its own session so that a timeout kills its whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ENV_TIMEOUT_S = 300.0  # environment query: imports torch and initialises CUDA once


def _child_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hybridmem.harness.child", *args]


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


def run_child(args: list[str], result_path: Path, log_path: Path, timeout_s: float) -> dict:
    """Run the child with `args`; its JSON result, or an `error` result saying why there is none."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(_child_cmd(*args), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
            why = None
        except subprocess.TimeoutExpired:
            why = f"timed out after {timeout_s:g} s"
        except BaseException:  # Ctrl-C or a kill of the parent: take the child down too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        if why:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
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
        result = run_child([str(req), str(res)], res, log, timeout_s)
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
