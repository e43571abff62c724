"""Speed and host memory of the trace tier on the issue's acceptance config.

`hybridmem predict --method trace --model llava-1.5-7b --seq-len 2048 --micro-batch 8
--train llm+projector --grad-ckpt` (target: <= 10 s on the 2-core CI machine). Each run is a
fresh interpreter, so the numbers include nothing cached; import time is reported apart.
Prints per-run times, the median, and the peak host RSS (a real run would need ~14 GB for the
bf16 weights alone, ~28 GB in fp32).

    python experiments/bench_trace.py [--runs 3] [--precision bf16-mixed]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from hybridmem.predict import predict
from hybridmem.job.spec import TrainingSpec
import hybridmem.trace, hybridmem.trace.runner, torch, transformers  # imports, timed apart
t1 = time.perf_counter()
spec = TrainingSpec(model="llava-1.5-7b", micro_batch=8, seq_len=2048, train="llm+projector",
                    grad_ckpt=True, precision=sys.argv[1])
pred = predict(spec, method="trace")
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "predict_s": t2 - t1,
                  "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "allocated_gib": pred.peak.allocated_bytes / 2**30,
                  "reserved_gib": pred.peak.reserved_bytes / 2**30,
                  "phase": pred.peak.phase, "iteration": pred.peak.iteration}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--precision", default="bf16-mixed")
    args = ap.parse_args()
    rows = []
    for i in range(args.runs):
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD, args.precision], capture_output=True,
                             text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        rows[-1]["process_s"] = time.perf_counter() - start
        print(f"run {i}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in rows[-1].items()))
    med = statistics.median(r["predict_s"] for r in rows)
    print(f"precision={args.precision}: median predict {med:.2f} s "
          f"(+ {statistics.median(r['import_s'] for r in rows):.2f} s imports; whole process "
          f"{statistics.median(r['process_s'] for r in rows):.2f} s), "
          f"max RSS {max(r['max_rss_mib'] for r in rows):.0f} MiB")


if __name__ == "__main__":
    main()
