"""Many analytic jobs at once: `hybridmem predict --jobs FILE.jsonl` with 1 and 2 worker
processes against one `hybridmem predict` process per job.

    python experiments/bench_many_jobs.py [--jobs 1000] [--singles 20] [--gpu h100-80gb]

Writes `--jobs` distinct analytic jobs (presets x micro-batch x seq x precision x GPUs/strategy;
with `--gpu`, each against that GPU: the verdict, and the advice where it does not fit or is
parallel, which prices a dozen variants per job) to a JSONL file, times the batch command with `--workers 1` and `2`,
and times `--singles` of the same jobs as separate CLI processes, extrapolated to all of them
(each process pays its own start: Python, the imports, the model graph). Checks that the batch
rows equal the single calls' answers (all but `job.sources`, which name the line or the flag).
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-7b", "mistral-7b-v0.3",
          "qwen3-4b", "phi-3-mini-4k-instruct", "gemma-2-2b", "llava-1.5-7b", "qwen2.5-1.5b")
MICRO = (1, 2, 4, 8, 16)
SEQ = (512, 1024, 2048, 4096)
PRECISION = ("bf16-mixed", "bf16-master")
LAYOUT = ((1, "none"), (2, "ddp"), (4, "zero2"), (4, "zero3"), (8, "fsdp"))


def jobs(n: int, gpu: str | None = None) -> list[dict]:
    grid = itertools.product(MODELS, MICRO, SEQ, PRECISION, LAYOUT)
    out = [{"model": m, "micro_batch": b, "seq_len": s, "precision": p, "world_size": w,
            "strategy": st, **({"gpu": gpu} if gpu else {})} for m, b, s, p, (w, st) in grid]
    assert len(out) >= n, f"the grid has {len(out)} jobs"
    return out[:n]


def flags(job: dict) -> list[str]:
    return [x for k, v in job.items() for x in (f"--{k.replace('_', '-')}", str(v))]


CPU = [0.0]
"""CPU seconds of the last `run` (its process and its workers): what a shared machine's
wall time hides."""


def run(argv: list[str]) -> tuple[float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "hybridmem.cli", *argv], check=True,
                         capture_output=True, text=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU[0] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return time.perf_counter() - t0, out


def strip(answer: dict) -> dict:
    return {**answer, "job": {k: v for k, v in answer["job"].items() if k != "sources"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--singles", type=int, default=20)
    parser.add_argument("--gpu", default=None)
    args = parser.parse_args()
    todo = jobs(args.jobs, args.gpu)
    step = max(1, len(MODELS) * len(MICRO) * len(SEQ) * len(PRECISION) * len(LAYOUT) // len(todo))
    todo = jobs(len(todo) * step, args.gpu)[::step]  # spread over the whole grid
    folder = Path(tempfile.mkdtemp(prefix="hybridmem-bench-"))
    path = folder / "jobs.jsonl"
    path.write_text("".join(json.dumps(j) + "\n" for j in todo))
    rows = {}
    for workers in (1, 2):
        wall, out = run(["predict", "--jobs", str(path), "--workers", str(workers), "--json"])
        rows[workers] = [json.loads(line) for line in out.splitlines()]
        errors = sum("error" in r for r in rows[workers])
        print(f"--jobs, {workers} worker(s){' against ' + args.gpu if args.gpu else ''}: {len(todo)} jobs in {wall:.1f} s = "
              f"{len(todo) / wall:.1f} jobs/s, {CPU[0]:.1f} CPU s ({errors} error rows)")
    assert rows[1] == rows[2], "the answers depend on the worker count"
    priced = [i for i, row in enumerate(rows[1]) if "error" not in row]
    step = max(1, len(priced) // args.singles)
    picked = priced[::step][:args.singles]
    total = cpu = 0.0
    for i in picked:
        wall, out = run(["predict", *flags(todo[i]), "--json"])
        total, cpu = total + wall, cpu + CPU[0]
        single, batch = json.loads(out), rows[1][i]
        assert strip(single) == strip({k: v for k, v in batch.items() if k != "line"}), i
    per = total / len(picked)
    print(f"single CLI calls: {len(picked)} in {total:.1f} s = {per:.2f} s each; "
          f"{len(todo)} would take {per * len(todo):.0f} s = {1 / per:.2f} jobs/s "
          f"({cpu / len(picked):.2f} CPU s each; the same answers as the batch rows)")


if __name__ == "__main__":
    main()
