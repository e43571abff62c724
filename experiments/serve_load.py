"""Load check of `hybridmem serve` (not part of the test suite): 200 analytic requests at
concurrency 16, their errors and p50/p95 latency, then `/healthz` while a trace request runs.

Starts `hybridmem serve` on a free port in a subprocess, as a user would. The 200 jobs are all
different (model x micro-batch x sequence length), so the cache answers none of them; a second
pass of the same jobs shows the cache.

    python experiments/serve_load.py [--requests 200] [--concurrency 16] [--trace-model M]
                                     [--serve-args "--workers 2"]
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

MODELS = ("llava-1.5-7b", "llama-3.2-1b", "qwen2.5-7b", "mistral-7b-v0.3", "tiny-llava")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jobs(n: int) -> list[dict]:
    """`n` different jobs (full and LoRA; 1024 tokens and more: LLaVA-1.5's 576 image tokens
    need room)."""
    grid = itertools.product(("full", "lora"), (1024, 2048), (False, True), (1, 2, 4, 8, 16),
                             MODELS)
    return [{"model": m, "train": t, "micro_batch": b, "seq_len": s, "grad_ckpt": c,
             "gpu": "h100-80gb", "method": "analytic"}
            for t, s, c, b, m in itertools.islice(grid, n)]


def timed(client: httpx.Client, body: dict) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = client.post("/v1/predict", json=body)
    return time.perf_counter() - t0, r.status_code


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def load(base: str, bodies: list[dict], concurrency: int) -> dict:
    with httpx.Client(base_url=base, timeout=600) as client, \
            ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(lambda b: timed(client, b), bodies))
        wall = time.perf_counter() - t0
    lat = [t for t, _ in results]
    return {"requests": len(results), "errors": sum(code != 200 for _, code in results),
            "p50_ms": round(1000 * percentile(lat, 50), 1),
            "p95_ms": round(1000 * percentile(lat, 95), 1), "wall_s": round(wall, 2)}


def health_during_trace(base: str, model: str) -> dict:
    out: dict = {}

    def trace():
        with httpx.Client(base_url=base, timeout=900) as c:
            t0 = time.perf_counter()
            r = c.post("/v1/predict", json={"model": model, "seq_len": 256, "method": "trace"})
            out["trace_status"], out["trace_s"] = r.status_code, round(time.perf_counter() - t0, 1)

    worker = threading.Thread(target=trace)
    worker.start()
    time.sleep(1.0)  # the trace is in the pool
    lat = []
    with httpx.Client(base_url=base, timeout=30) as c:
        while worker.is_alive() and len(lat) < 50:
            t0 = time.perf_counter()
            c.get("/healthz").raise_for_status()
            lat.append(time.perf_counter() - t0)
            time.sleep(0.2)
    worker.join()
    out.update(healthz_checks=len(lat), healthz_max_ms=round(1000 * max(lat), 1) if lat else None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--trace-model", default="llama-3.2-1b")
    ap.add_argument("--serve-args", default="", help="more `hybridmem serve` options")
    args = ap.parse_args()
    port = _port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "hybridmem", "serve", "--port", str(port),
                               *args.serve_args.split()],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"{base}/healthz", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.3)
        bodies = jobs(args.requests)
        # warm: the first request imports the tiers (a job outside the list)
        httpx.post(f"{base}/v1/predict", json={"model": "tiny-llava", "seq_len": 64}, timeout=600)
        report = {"uncached": load(base, bodies, args.concurrency)}
        report["cached"] = load(base, bodies, args.concurrency)
        report["healthz_during_trace"] = health_during_trace(base, args.trace_model)
        print(json.dumps(report, indent=2))
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
