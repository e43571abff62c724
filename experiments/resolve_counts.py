"""Calls per CLI call and per HTTP request of the tier chooser (`choose_method`) and of the
model-defaults resolver (`resolve_defaults`), counted by profiling every thread.

    python experiments/resolve_counts.py

Why: docs/design.md "Which tier answers" says a job is resolved and its tier chosen once per
request (`intake.resolve.resolve_once`); this counts it. The resolver's later calls are the
tiers' own entry guards, which return at once on a resolved spec.
"""

from __future__ import annotations

import collections
import contextlib
import io
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, not whichever is installed

NAMES = frozenset({"choose_method", "resolve_defaults"})
counts: collections.Counter = collections.Counter()


def _profile(frame, event, arg):
    if event == "call" and frame.f_code.co_name in NAMES \
            and "hybridmem" in frame.f_code.co_filename:
        counts[frame.f_code.co_name] += 1


def count(label: str, run) -> None:
    counts.clear()
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    print(f"{label}: choose_method={counts['choose_method']} "
          f"resolve_defaults={counts['resolve_defaults']}")


def main() -> None:
    from fastapi.testclient import TestClient

    from hybridmem.cli import main as cli
    from hybridmem.serve.app import Settings, create_app

    def run_cli(args):
        def go():
            with contextlib.redirect_stdout(io.StringIO()):
                cli(args)
        return go

    client = TestClient(create_app(Settings(trace_workers=0, workdir=tempfile.mkdtemp())))

    def post(body):
        def go():
            response = client.post("/v1/predict", json=body)
            assert response.status_code == 200, response.text
        return go

    base = ["predict", "--model", "llama-3.2-3b", "--micro-batch", "2", "--seq-len", "512"]
    count("CLI  predict", run_cli(base))
    count("CLI  predict --gpu h100-80gb", run_cli(base + ["--gpu", "h100-80gb"]))
    body = {"model": "llama-3.2-3b", "micro_batch": 2, "seq_len": 513}  # no cache hit
    count("HTTP POST /v1/predict", post(body))
    count("HTTP POST /v1/predict gpu", post({**body, "seq_len": 514, "gpu": "h100-80gb"}))
    count("HTTP POST /v1/predict gpu every_gpu",
          post({**body, "seq_len": 515, "gpu": "h100-80gb", "every_gpu": True}))


if __name__ == "__main__":
    main()
