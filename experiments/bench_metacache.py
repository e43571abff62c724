"""The trace tier with and without the memoised meta kernels (hybridmem/trace/metacache.py).

Each run is a fresh interpreter that imports torch + transformers + the family's modeling code,
then times `hybridmem.trace.estimate(spec, gpu=H100)`: wall time and the process's CPU time (which
a shared machine disturbs less); "off" replaces `metacache.call` with the plain kernel call.
Results (peak allocated, reserved, events) must be identical.

    python experiments/bench_metacache.py [--model llava-1.5-7b] [--runs 2]
        [--out experiments/results/metacache]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORK = r"""
import json, sys, time
import torch, transformers, importlib
importlib.import_module(sys.argv[1])
from hybridmem.gpus import gpu_by_name
from hybridmem.job.spec import TrainingSpec
from hybridmem.trace import estimate, metacache
if sys.argv[3] == "off":
    metacache.call = lambda func, args, kwargs: func(*args, **(kwargs or {}))
wall, cpu = time.perf_counter(), time.process_time()
pred = estimate(TrainingSpec(model=sys.argv[2]), gpu=gpu_by_name("h100-80gb"))
print(json.dumps({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                  "allocated": pred.peak.allocated_bytes, "reserved": pred.peak.reserved_bytes,
                  "events": pred.extras["trace"]["events"], "keys": len(metacache._cache)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llava-1.5-7b")
    ap.add_argument("--modeling", default="transformers.models.llava.modeling_llava")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default="experiments/results/metacache")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    load = os.getloadavg()[0]
    runs = {"off": [], "on": []}
    for _ in range(args.runs):  # interleaved, so both see the same machine load
        for mode in runs:
            out = subprocess.run([sys.executable, "-c", WORK, args.modeling, args.model, mode],
                                 capture_output=True, text=True, check=True, env=env)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    same = len({(r["allocated"], r["reserved"], r["events"]) for r in runs["off"] + runs["on"]}) == 1
    row = {m: {"wall_s": statistics.median(r["wall_s"] for r in rs),
               "cpu_s": statistics.median(r["cpu_s"] for r in rs), "keys": rs[0]["keys"]}
           for m, rs in runs.items()}
    meta = {"when": time.strftime("%Y-%m-%d %H:%M"), "load_average_at_start": load,
            "model": args.model, "runs": args.runs, "identical": same, **row,
            "result": {k: runs["on"][0][k] for k in ("allocated", "reserved", "events")}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    text = (f"Measured {meta['when']}, load average {load:.1f} at start, {args.model}, medians of "
            f"{args.runs} fresh processes each:\n\n| meta kernels | wall | CPU | keys |\n"
            f"|---|---:|---:|---:|\n" + "".join(
                f"| {'memoised' if m == 'on' else 'every call'} | {row[m]['wall_s']:.2f} s | "
                f"{row[m]['cpu_s']:.2f} s | {row[m]['keys']} |\n" for m in ("off", "on")) +
            f"\nidentical results: {'yes' if same else 'NO'} ({meta['result']})\n")
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
