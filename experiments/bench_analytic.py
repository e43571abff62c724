"""Speed of the analytic tier (the issue asks for "well under a second after import").

Runs in a fresh interpreter so import costs are real: times `import hybridmem`, a cold
`hybridmem.analytic.estimate` (no torch / transformers import), the first
`hybridmem.predict.predict` (which may import transformers to validate the config), warm
estimates, and a `--find-max-batch` search, for the issue's acceptance command.

    python experiments/bench_analytic.py
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import hybridmem
from hybridmem import TrainingSpec
from hybridmem.gpus import GPUS
t1 = time.perf_counter()
t_import = t1 - t0
from hybridmem.analytic import estimate
estimate(TrainingSpec(model="llava-1.5-7b", micro_batch=8, seq_len=2048, train="llm+projector",
                      grad_ckpt=True, precision="bf16-master"))
t_cold = time.perf_counter() - t1
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
t1 = time.perf_counter()
from hybridmem.predict import predict
spec = TrainingSpec(model="llava-1.5-7b", micro_batch=8, seq_len=2048, train="llm+projector",
                    grad_ckpt=True, precision="bf16-master")
predict(spec, method="analytic")
t2 = time.perf_counter()
n = 50
for _ in range(n):
    predict(spec, method="analytic")
t3 = time.perf_counter()
gpu = GPUS["h100-80gb"]
res = predict(spec.with_(precision="bf16-mixed", optimizer="adamw-8bit"), method="analytic",
              gpu=gpu, find_max_batch=True)
t4 = time.perf_counter()
print(json.dumps({"import_s": t_import, "cold_analytic_estimate_s": t_cold,
                  "heavy_imports_after_estimate": ",".join(heavy) or "none",
                  "first_predict_s": t2 - t1,
                  "warm_estimate_ms": (t3 - t2) / n * 1e3, "find_max_batch_s": t4 - t3,
                  "max_micro_batch": res.max_micro_batch}))
"""


def main() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    for k, v in row.items():
        print(f"{k:>18}: {v:.4g}" if isinstance(v, float) else f"{k:>18}: {v}")


if __name__ == "__main__":
    main()
