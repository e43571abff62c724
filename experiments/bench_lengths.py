"""`--lengths` on 100,000 samples: wall time, and the lengths-aware answer beside the fixed one.

The lengths are SYNTHETIC (a log-normal of token counts, median ~245, made here with a fixed
seed): they show the mechanism and its cost, they are no dataset's distribution. The job is
shaped like the peft MetaMathQA benchmark's (llama-3.2-3b, LoRA r 8, bf16, micro-batch 4, the
custom loop, clipping, cap 768), so the figures read next to docs/accuracy.md's rows, but
they are no check of those rows (their per-sample lengths are not available offline).

    python experiments/bench_lengths.py [--samples 100000] [--method analytic] [--gpu l40s]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package

from hybridmem.gpus import gpu_by_name  # noqa: E402
from hybridmem.job.spec import TrainingSpec  # noqa: E402
from hybridmem.predict import predict  # noqa: E402

GiB = 1 << 30


def synthetic(n: int, seed: int = 0) -> np.ndarray:
    """SYNTHETIC token counts: log-normal (mu 5.5, sigma 0.45), at least 8."""
    rng = np.random.default_rng(seed)
    return np.maximum(rng.lognormal(5.5, 0.45, n).astype(np.int64), 8)


JOB = TrainingSpec(model="llama-3.2-3b", train="lora", precision="bf16", micro_batch=4,
                  seq_len=768, loop="custom", max_grad_norm=1.0)
"""Shaped like the peft MetaMathQA benchmark's job (docs/accuracy.md)."""


VARIANTS = ({"sampler": "random"}, {"sampler": "group_by_length"})
"""Job fields of each `--lengths` run (a sampler; optionally `max_steps`)."""


def runs(samples: int = 100_000, method: str = "analytic", gpu=None,
         variants: tuple[dict, ...] = VARIANTS) -> dict:
    """The job at the cap, then over `samples` SYNTHETIC lengths with each variant's job
    fields: wall times and the `lengths` figures."""
    spec = JOB
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synthetic-lengths.txt"
        path.write_text("\n".join(map(str, synthetic(samples))))
        start = time.perf_counter()
        fixed = predict(spec, method=method, gpu=gpu)
        t_fixed = time.perf_counter() - start
        rows = []
        for fields in variants:
            start = time.perf_counter()
            run = predict(spec.with_(lengths=str(path), **fields), method=method, gpu=gpu)
            wall = time.perf_counter() - start
            info = run.extras["lengths"]
            rows.append({
                **fields, "samples": info["samples"], "steps": info["steps"],
                "distinct_shapes": len(info["distinct_shapes"]),
                "replayed_steps": info["replayed_steps"], "wall_s": round(wall, 2),
                "padded_tokens": info["padded_tokens"],
                "longest_batch": info["longest_batch"],
                "reserved_fixed_at_cap_gib": round(fixed.peak.reserved_bytes / GiB, 3),
                "reserved_at_longest_batch_gib":
                    round(info["reserved_at_longest_batch_bytes"] / GiB, 3),
                "reserved_lengths_aware_gib": round(run.peak.reserved_bytes / GiB, 3),
                "reserved_per_step_gib": {k: round(v / GiB, 3)
                                          for k, v in info["reserved_per_step"].items()},
                "peak_step": info["peak_step"], "num_alloc_retries": info["num_alloc_retries"],
                "oom": info["oom"]})
    return {"method": method, "fixed_wall_s": round(t_fixed, 2), "runs": rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--method", default="analytic")
    ap.add_argument("--gpu", default=None)
    args = ap.parse_args(argv)
    gpu = gpu_by_name(args.gpu) if args.gpu else None
    print(json.dumps({**runs(args.samples, args.method, gpu), "gpu": args.gpu}, indent=1))


if __name__ == "__main__":
    main()
