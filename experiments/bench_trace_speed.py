"""The trace tier's own work as a ratio to the import floor, fast path vs full trace.

Import floor: a fresh interpreter importing torch + transformers + the family's modeling module
(what any trace pays before it starts). Trace work: `hybridmem.trace.estimate(spec, gpu=H100)`
in a fresh interpreter after the same imports, timed apart; once with the fast path (a few
layers traced, the pattern repeated: hybridmem/trace/repeat.py), once with every layer traced
(`HYBRIDMEM_TRACE_FULL=1`). Each is the median of `--runs` fresh processes; the ratio uses the
floor measured in the same run. Goal (issue): <= 0.5 x the floor for a 7B step, <= 1 x for 70B.

Configs: the README's `hybridmem predict --model llava-1.5-7b --gpu h100-80gb --method trace`
(spec defaults: micro-batch 1, seq 2048, bf16-mixed, full fine-tune, AdamW), llama-3.2-3b, and
a 70B-shaped decoder written from meta-llama/Meta-Llama-3-70B's published config.json (hidden
8192, intermediate 28672, 80 layers, 64 heads, 8 kv heads, vocab 128256, rope_theta 500000,
rms_norm_eps 1e-5, untied embeddings).

    python experiments/bench_trace_speed.py [--runs 3] [--out experiments/results/trace_speed]

Writes `<out>.json` and `<out>.md` (the table docs/trace.md cites).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA3_70B = {  # meta-llama/Meta-Llama-3-70B config.json (published on the model's page)
    "_source": "meta-llama/Meta-Llama-3-70B config.json (transcribed)",
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}

FLOOR = r"""
import sys, time
t0 = time.perf_counter()
import torch, transformers, importlib
importlib.import_module(sys.argv[1])
print(time.perf_counter() - t0)
"""

WORK = r"""
import json, sys, time
import torch, transformers, importlib
importlib.import_module(sys.argv[1])
from hybridmem.gpus import gpu_by_name
from hybridmem.job.spec import TrainingSpec
from hybridmem.trace import estimate
from doc_block import write_results  # experiments/ is on the path of a script run
spec = TrainingSpec(model=sys.argv[2])
t0 = time.perf_counter()
pred = estimate(spec, gpu=gpu_by_name("h100-80gb"))
work = time.perf_counter() - t0
print(json.dumps({"work_s": work, "allocated": pred.peak.allocated_bytes,
                  "reserved": pred.peak.reserved_bytes, "phase": pred.peak.phase,
                  "iteration": pred.peak.iteration, "breakdown": pred.breakdown,
                  "events": pred.extras["trace"]["events"],
                  "fast": any("layers traced" in n for n in pred.notes)}))
"""

MODELING = {"llava": "transformers.models.llava.modeling_llava",
            "llama": "transformers.models.llama.modeling_llama"}


def _run(code: str, *args: str, full: bool = False) -> str:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env["HYBRIDMEM_TRACE_FULL"] = "1" if full else "0"
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         check=True, env=env)
    return out.stdout.strip().splitlines()[-1]


def bench(name: str, model: str, family: str, runs: int, full_runs: int) -> dict:
    module = MODELING[family]
    floor = statistics.median(float(_run(FLOOR, module)) for _ in range(runs))
    fast = [json.loads(_run(WORK, module, model)) for _ in range(runs)]
    full = [json.loads(_run(WORK, module, model, full=True)) for _ in range(full_runs)]
    same = all({k: v for k, v in r.items() if k not in ("work_s", "fast")}
               == {k: v for k, v in full[0].items() if k not in ("work_s", "fast")}
               for r in fast + full)
    row = {"config": name, "floor_s": floor,
           "fast_s": statistics.median(r["work_s"] for r in fast),
           "full_s": statistics.median(r["work_s"] for r in full),
           "fast_taken": all(r["fast"] for r in fast), "identical": same,
           "events": full[0]["events"], "allocated": full[0]["allocated"],
           "reserved": full[0]["reserved"], "runs": runs, "full_runs": full_runs}
    row["fast_ratio"] = row["fast_s"] / floor
    row["full_ratio"] = row["full_s"] / floor
    print(f"{name}: floor {floor:.2f} s; fast {row['fast_s']:.2f} s ({row['fast_ratio']:.2f}x), "
          f"full {row['full_s']:.2f} s ({row['full_ratio']:.2f}x); identical={same}",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--full-runs", type=int, default=None, help="default: --runs")
    ap.add_argument("--out", default="experiments/results/trace_speed")
    ap.add_argument("--only", default=None, help="comma-separated config names")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    seventy = tmp / "llama-3-70b.json"
    seventy.write_text(json.dumps(LLAMA3_70B))
    configs = [("llava-1.5-7b", "llava-1.5-7b", "llava"),
               ("llama-3.2-3b", "llama-3.2-3b", "llama"),
               ("llama-3-70b-shaped", str(seventy), "llama")]
    if args.only:
        configs = [c for c in configs if c[0] in args.only.split(",")]
    load = os.getloadavg()[0]
    rows = [bench(*c, args.runs, args.full_runs or args.runs) for c in configs]
    out = Path(args.out)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M"), "load_average_at_start": load,
            "cpus": os.cpu_count(), "rows": rows}
    print(write_results(
        out, meta, f"Measured {meta['when']}, {meta['cpus']} CPUs, load average {load:.1f} at "
        f"start; medians of {args.runs} fresh processes (full trace: "
        f"{args.full_runs or args.runs}).",
        "| config | import floor | fast path | ratio | full trace | ratio | events | identical |",
        [f"| {r['config']} | {r['floor_s']:.2f} s | {r['fast_s']:.2f} s | "
         f"{r['fast_ratio']:.2f} | {r['full_s']:.2f} s | {r['full_ratio']:.2f} | "
         f"{r['events']} | {'yes' if r['identical'] and r['fast_taken'] else 'NO'} |"
         for r in rows]))


if __name__ == "__main__":
    main()
