"""Probe `hybridmem serve` with hostile requests (not part of the test suite): status, message,
seconds, and whether a core stays busy afterwards; then the process tree before and after
SIGTERM following a trace job.

Each case gets a fresh server (`hybridmem serve --timeout T` on a free port, as a user starts
it), so one case's leftover work cannot colour the next; the server is killed after its case.
"Busy after" is the server's process tree (it and every child) using more than a quarter core,
sampled for one second starting one second after the answer (psutil).

    python experiments/serve_probe.py [--timeout 5] [--cases] [--sigterm] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
BASE_JOB = {"model": "llama-3.1-8b", "train": "lora"}


def cases(lengths_file: str) -> list[tuple[str, dict]]:
    return [
        ("lengths=/etc/passwd", {**BASE_JOB, "lengths": "/etc/passwd"}),
        ("lengths=/proc/self/environ", {**BASE_JOB, "lengths": "/proc/self/environ"}),
        ("lengths=missing path", {**BASE_JOB, "lengths": "/nonexistent/lengths.txt"}),
        ("lengths=existing lengths file", {**BASE_JOB, "lengths": lengths_file}),
        ("lengths=the file's text inline", {**BASE_JOB, "lengths": Path(lengths_file).read_text()}),
        ("micro_batch=10**400", {**BASE_JOB, "micro_batch": 10**400, "gpu": "rtx-4090"}),
        ("micro_batch=10**20", {**BASE_JOB, "micro_batch": 10**20, "gpu": "rtx-4090"}),
        ("world_size=10**9", {**BASE_JOB, "world_size": 10**9, "strategy": "zero3",
                              "gpu": "rtx-4090"}),
        # within every bound, yet slower than a 5 s limit: does the 504 free the core?
        ("slow job in bounds", {**BASE_JOB, "micro_batch": 4096, "seq_len": 1 << 20,
                                "gpu": "rtx-4090"}),
    ]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(timeout: float, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "hybridmem", "serve", "--port", str(port),
                               "--timeout", str(timeout), *extra], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        try:
            httpx.get(f"{base}/healthz", timeout=1).raise_for_status()
            return server, base
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise SystemExit("the server did not start") from None
            time.sleep(0.3)


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def busy_cores(pid: int) -> float:
    """Cores the process tree of `pid` used over one second, a second from now."""
    time.sleep(1.0)
    procs = tree(pid)
    before = {}
    for p in procs:
        try:
            t = p.cpu_times()
            before[p.pid] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    time.sleep(1.0)
    used = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            used += t.user + t.system - before.get(p.pid, t.user + t.system)
        except psutil.NoSuchProcess:
            pass
    return used


def kill_tree(server: subprocess.Popen) -> None:
    for p in reversed(tree(server.pid)):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    server.wait(30)


def run_cases(timeout: float, extra: list[str], only: str | None = None) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        lengths = Path(folder) / "lengths.txt"
        lengths.write_text("".join(f"{n}\n" for n in (512, 1024, 2048, 300) * 50))
        for name, body in cases(str(lengths)):
            if only and only not in name:
                continue
            server, base = start(timeout, extra)
            try:
                warm = {"model": "tiny-llava", "seq_len": 64, "method": "analytic"}
                httpx.post(f"{base}/v1/predict", json=warm, timeout=120)  # imports the tier
                t0 = time.perf_counter()
                try:
                    r = httpx.post(f"{base}/v1/predict", content=json.dumps(body),
                                   headers={"content-type": "application/json"},
                                   timeout=timeout + 60)
                    try:
                        detail = r.json().get("detail") if r.status_code != 200 \
                            else "(an answer)"
                    except ValueError:  # not JSON: a bare 500
                        detail = r.text[:120]
                    status = r.status_code
                except httpx.HTTPError as err:
                    status, detail = "no answer", type(err).__name__
                seconds = time.perf_counter() - t0
                cores = busy_cores(server.pid)
                rows.append({"case": name, "status": status, "message": str(detail)[:160],
                             "seconds": round(seconds, 2), "busy_cores_after": round(cores, 2),
                             "core_busy": cores > 0.25})
                print(json.dumps(rows[-1]), flush=True)
            finally:
                kill_tree(server)
    return rows


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())[:110]
            out.append(f"{p.pid} ppid={p.ppid()} rss={p.memory_info().rss >> 20}MiB {cmd}")
        except psutil.NoSuchProcess:
            out.append(f"{p.pid} (gone)")
    return out


def sigterm_after_trace(extra: list[str], in_flight: bool) -> dict:
    """SIGTERM after a trace job answered (`in_flight` False), or while one runs (True: a
    larger model's trace, signalled 5 s after it was sent); what outlives the server."""
    server, base = start(600, extra)
    before: list[psutil.Process] = []
    out: dict = {"in_flight": in_flight}
    try:
        warm = {"model": "tiny-llava", "seq_len": 64, "method": "trace"}
        r = httpx.post(f"{base}/v1/predict", json=warm, timeout=600)
        out["trace_status"] = r.status_code
        if in_flight:
            body = {"model": "llama-3.2-1b", "seq_len": 1024, "method": "trace"}
            threading.Thread(target=lambda: _quiet_post(base, body), daemon=True).start()
            time.sleep(5.0)
        before = tree(server.pid)
        out["before_sigterm"] = describe(before)
        t0 = time.perf_counter()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
            out["server_exit_s"] = round(time.perf_counter() - t0, 2)
        except subprocess.TimeoutExpired:
            out["server_exit_s"] = "still running after 60 s"
        time.sleep(3.0)
        alive = [p for p in before if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        out["alive_3s_after_exit"] = describe(alive)
        return out
    finally:
        for p in [*tree(server.pid), *before]:  # what outlived SIGTERM, so the probe leaves none
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def _quiet_post(base: str, body: dict) -> None:
    try:
        httpx.post(f"{base}/v1/predict", json=body, timeout=600)
    except httpx.HTTPError:
        pass  # the server was told to stop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=5.0, help="the server's --timeout")
    ap.add_argument("--cases", action="store_true", help="only the hostile requests")
    ap.add_argument("--sigterm", action="store_true", help="only the SIGTERM check")
    ap.add_argument("--only", help="only the cases whose name contains this")
    ap.add_argument("--json", type=Path, help="write the report here")
    ap.add_argument("serve_args", nargs="*", help="more `hybridmem serve` options (after --)")
    args = ap.parse_args()
    both = not (args.cases or args.sigterm)
    report: dict = {"python": sys.version.split()[0], "pid": os.getpid()}
    if args.cases or both:
        report["cases"] = run_cases(args.timeout, args.serve_args, args.only)
    if args.sigterm or both:
        report["sigterm"] = [sigterm_after_trace(args.serve_args, busy) for busy in (False, True)]
        print(json.dumps(report["sigterm"], indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
