"""Every tier's answer on a fixed set of jobs, as JSON: checks that a refactor changed no answer.

    python experiments/answers_snapshot.py --out answers.json [--tiers analytic,trace] [--quick]
    python experiments/answers_snapshot.py --compare before.json after.json

The jobs: the analytic-vs-trace grid of tests/test_analytic_vs_trace.py (GRID + EXTRA), one
real-sized job per preset family (analytic only; the trace tier for the small ones), and the
165 published rows (`datasets/published`, rebuilt with `harness.schema.spec_from_row`). An
answer is the numbers of `Prediction.to_dict()` (peaks, breakdown, modules, parameter counts);
notes, the tier name and any echo of the job are left out, since wording may change while the
memory may not. `--compare` lists every job whose numbers differ, field by field.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, not whichever is installed

# the numbers of an answer; anything else (notes, method, job echo) is wording
NUMERIC_KEYS = ("params", "peak", "breakdown", "modules", "paged_bytes")

# real-sized jobs, one per family; the trace tier prices those marked small
REAL = [
    dict(model="llava-1.5-7b", micro_batch=8, seq_len=2048, train="llm+projector",
         grad_ckpt=True, precision="bf16-master"),
    dict(model="llama-3.2-3b", micro_batch=2, seq_len=2048, train="lora", grad_ckpt=True,
         precision="bf16"),
    dict(model="llama-3.2-3b", micro_batch=2, seq_len=1024, train="lora", quantize="nf4",
         precision="bf16"),
    dict(model="qwen2.5-vl-7b-instruct", micro_batch=2, seq_len=4096, train="lora",
         grad_ckpt=True, precision="bf16", image_size="1024x1024"),
    dict(model="qwen3-8b", micro_batch=1, seq_len=4096, precision="bf16", grad_ckpt=True),
    dict(model="gemma-2-9b", micro_batch=1, seq_len=2048, attn="eager", precision="bf16"),
    dict(model="phi-4", micro_batch=1, seq_len=2048, train="lora", precision="bf16-mixed"),
    dict(model="mixtral-8x7b-v0.1", micro_batch=1, seq_len=1024, precision="bf16"),
    dict(model="idefics3-8b-llama3", micro_batch=1, seq_len=4096, train="lora", grad_ckpt=True,
         precision="bf16"),
    dict(model="internvl3-2b-hf", micro_batch=2, seq_len=4096, train="lora", grad_ckpt=True,
         precision="bf16"),
    dict(model="gemma-3-4b-it", micro_batch=2, seq_len=2048, train="lora", grad_ckpt=True,
         precision="bf16"),
    dict(model="qwen3-vl-2b-instruct", micro_batch=1, seq_len=2048, train="lora",
         precision="bf16"),
    dict(model="pixtral-12b", micro_batch=1, seq_len=4096, train="lora", grad_ckpt=True,
         precision="bf16", image_size="512x768"),
    dict(model="smolvlm-256m-instruct", micro_batch=2, seq_len=2048, precision="bf16-mixed"),
    dict(model="llava-1.5-7b", micro_batch=4, seq_len=2048, train="lora", quantize="nf4",
         grad_ckpt=True, precision="bf16", liger=True, optimizer="paged-adamw-8bit"),
    dict(model="llama-3.2-3b", micro_batch=4, seq_len=2048, precision="bf16",
         offload_activations="all", grad_ckpt=True, train="lora"),
    dict(model="llama-3.2-3b", micro_batch=2, seq_len=2048, precision="bf16", packing=True,
         chunked_ce=8, train="lora"),
    dict(model="llama-3.2-3b", micro_batch=2, seq_len=2048, precision="bf16",
         world_size=8, strategy="zero3"),
]
TRACE_REAL = {0, 1, 2, 13}

# every objective and its reference / generation variants (hybridmem.objectives): small jobs
# both tiers price, then real-sized ones the analytic tier prices
_TINY = dict(model="tiny-llama", micro_batch=2, seq_len=64, optimizer="adamw")
OBJECTIVE_JOBS = [
    dict(_TINY, objective="sft", trainer="trl", precision="bf16-mixed"),
    dict(_TINY, objective="dpo", precision="fp32"),
    dict(_TINY, objective="dpo", train="lora", precision="bf16-mixed", grad_ckpt=True),
    dict(_TINY, objective="dpo", ref_model="precomputed", precision="bf16"),
    dict(_TINY, objective="orpo", precision="bf16-mixed"),
    dict(_TINY, objective="kto", train="lora", precision="bf16"),
    dict(_TINY, objective="kto", ref_model="precomputed", precision="fp32"),
    dict(_TINY, objective="rm", precision="bf16-mixed"),
    dict(_TINY, objective="grpo", num_generations=2, max_completion_length=16,
         precision="bf16-mixed"),
    dict(_TINY, objective="grpo", num_generations=2, max_completion_length=16, beta=0.04,
         num_iterations=2, train="lora", precision="bf16"),
]
OBJECTIVE_REAL = [
    dict(model="llama-3.2-3b", micro_batch=2, seq_len=2048, train="lora", grad_ckpt=True,
         precision="bf16", objective="dpo"),
    dict(model="llama-3.2-3b", micro_batch=8, seq_len=1024, train="lora", grad_ckpt=True,
         precision="bf16", objective="grpo", beta=0.04, max_completion_length=256),
    dict(model="qwen3-8b", micro_batch=1, seq_len=2048, train="lora", precision="bf16",
         objective="kto"),
    dict(model="qwen3-8b", micro_batch=1, seq_len=2048, train="lora", precision="bf16",
         objective="rm"),
]


def _grid() -> list[dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    import test_analytic_vs_trace as grid  # noqa: E402  (the tests' own grid)

    return [dict(g) for g in grid.GRID + grid.EXTRA]


def _spec(kw: dict):
    from hybridmem import TrainingSpec
    from hybridmem.job.parallel import ParallelSpec

    kw = dict(kw)
    par = {k: kw.pop(k) for k in ("world_size", "strategy") if k in kw}
    if par:
        kw["parallel"] = ParallelSpec(**par)
    return TrainingSpec(**kw)


def _numbers(result) -> dict:
    d = result.to_dict()
    out = {k: d.get(k) for k in NUMERIC_KEYS}
    objective = d.get("objective")  # `extras["objective"]`: the reference's and the
    if objective is not None:       # generation's bytes (hybridmem.objectives)
        out["objective"] = objective
    return out


def _jobs(quick: bool) -> list[tuple[str, object, tuple[str, ...]]]:
    jobs = []
    for kw in _grid():
        jobs.append(("grid:" + json.dumps(kw, sort_keys=True, default=str), _spec(kw),
                     ("analytic", "trace")))
    for i, kw in enumerate(REAL):
        tiers = ("analytic", "trace") if i in TRACE_REAL else ("analytic",)
        jobs.append(("real:" + json.dumps(kw, sort_keys=True), _spec(kw), tiers))
    for kw in OBJECTIVE_JOBS:
        jobs.append(("objective:" + json.dumps(kw, sort_keys=True), _spec(kw),
                     ("analytic", "trace")))
    for kw in OBJECTIVE_REAL:
        jobs.append(("objective:" + json.dumps(kw, sort_keys=True), _spec(kw), ("analytic",)))
    if not quick:
        import pandas as pd

        from hybridmem.harness.schema import spec_from_row

        rows = pd.concat(pd.read_parquet(p) for p in
                         sorted((ROOT / "datasets" / "published").glob("*.parquet")))
        for _, row in rows.iterrows():
            jobs.append((f"published:{row['spec_hash']}", spec_from_row(row),
                         ("analytic", "trace")))
    return jobs


def snapshot(tiers: tuple[str, ...], quick: bool) -> dict:
    from hybridmem.predict import predict

    out: dict = {}
    for name, spec, job_tiers in _jobs(quick):
        entry = out.setdefault(name, {})
        for tier in (t for t in job_tiers if t in tiers):
            t0 = time.perf_counter()
            try:
                entry[tier] = _numbers(predict(spec, method=tier))
            except Exception as exc:  # an answer too: a refusal must stay a refusal
                entry[tier] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{tier:8s} {time.perf_counter() - t0:6.2f}s {name[:110]}", file=sys.stderr)
    return out


def _diff(a: object, b: object, path: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            _diff(a.get(k), b.get(k), f"{path}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out)
    elif a != b:
        out.append(f"{path}: {a!r} -> {b!r}")


def compare(before: dict, after: dict) -> list[str]:
    out: list[str] = []
    for name in sorted(set(before) | set(after)):
        _diff(before.get(name), after.get(name), name[:140], out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--tiers", default="analytic,trace")
    ap.add_argument("--quick", action="store_true", help="skip the 165 published rows")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args(argv)
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        diffs = compare(before, after)
        print("\n".join(diffs) if diffs else f"identical: {len(before)} jobs")
        return 1 if diffs else 0
    result = snapshot(tuple(args.tiers.split(",")), args.quick)
    text = json.dumps(result, indent=1, sort_keys=True, default=str) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
