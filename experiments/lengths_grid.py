"""The analytic and trace tiers over a grid of `--lengths` runs: reserved peak of each, and the
growth each adds over its own fixed-shape answer (docs/lengths.md, "Why the tiers disagree").

Grid: 3 SYNTHETIC length distributions (made here with a fixed seed: no dataset's) x 2 samplers
(`random`, `group_by_length`) x 3 shipped decoder presets (~0.5B, ~3B, ~8B), each a LoRA job
shaped like the peft MetaMathQA benchmark's (bf16, micro-batch 4, custom loop, clipping, cap
768; `experiments/bench_lengths.py`'s JOB), no GPU (unlimited allocator). The trace tier runs
on meta tensors: one trace per distinct batch shape (at most 8) plus its answer's.

Per cell: each tier's reserved peak over the run (`predict(..., lengths=FILE)`), its reserved
at the longest batch as one fixed shape, the growth (the difference), the analytic tier's
reserved peak against the trace tier's in %, whether the run's first step is its longest
shape, and the tier `choose_method` takes for the job.

    python experiments/lengths_grid.py            # the whole grid (~10 min on 2 cores)
    python experiments/lengths_grid.py --quick    # 0.5B only, 2 distributions, 600 samples
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package
sys.path.insert(0, str(ROOT / "experiments"))

from bench_lengths import JOB  # noqa: E402

from hybridmem.intake.resolve import choose_method  # noqa: E402
from hybridmem.predict import predict  # noqa: E402

GiB = 1 << 30
MODELS = ("qwen2.5-0.5b", "llama-3.2-3b", "llama-3.1-8b")
SAMPLERS = ("random", "group_by_length")


def distribution(name: str, n: int, seed: int = 0) -> np.ndarray:
    """SYNTHETIC token counts, at least 8 (the cap truncates at 768)."""
    rng = np.random.default_rng(seed)
    if name == "lognormal":  # median ~245, as bench_lengths.synthetic
        x = rng.lognormal(5.5, 0.45, n)
    elif name == "bimodal":  # short chat turns and long documents, 60 / 40
        short = rng.random(n) < 0.6
        x = np.where(short, rng.normal(120, 30, n), rng.normal(600, 80, n))
    elif name == "uniform":
        x = rng.uniform(32, 768, n)
    else:
        raise ValueError(name)
    return np.maximum(x.astype(np.int64), 8)


def cell(model: str, dist: str, sampler: str, samples: int, folder: Path) -> dict:
    path = folder / f"{dist}.txt"
    if not path.exists():
        path.write_text("\n".join(map(str, distribution(dist, samples))))
    spec = JOB.with_(model=model, lengths=str(path), sampler=sampler)
    row = {"model": model, "dist": dist, "sampler": sampler}
    for method in ("trace", "analytic"):
        start = time.perf_counter()
        run = predict(spec, method=method)
        info = run.extras["lengths"]
        row[method] = {"run": run.peak.reserved_bytes,
                       "fixed": info["reserved_at_longest_batch_bytes"],
                       "growth": info["shape_growth_bytes"], "wall": time.perf_counter() - start,
                       "first_longest": info["longest_batch"]["first_step"] == 0,
                       "shapes": len(info["distinct_shapes"])}
    row["diff_pct"] = 100 * (row["analytic"]["run"] / row["trace"]["run"] - 1)
    row["chosen"] = choose_method(spec).method
    return row


def show(row: dict) -> str:
    a, t = row["analytic"], row["trace"]
    return (f"| {row['model']} | {row['dist']} | {row['sampler']} | {t['shapes']} | "
            f"{'yes' if t['first_longest'] else 'no'} | "
            f"{t['run'] / GiB:.2f} (+{t['growth'] / GiB:.2f}) | "
            f"{a['run'] / GiB:.2f} (+{a['growth'] / GiB:.2f}) | {row['diff_pct']:+.1f} % | "
            f"{row['chosen']} | {t['wall']:.0f} / {a['wall']:.1f} s |")


HEADER = ("| model | lengths | sampler | shapes | first step longest | trace reserved GiB "
          "(+growth) | analytic reserved GiB (+growth) | analytic vs trace | chosen tier | "
          "wall trace / analytic |\n|---|---|---|---:|---|---:|---:|---:|---|---:|")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="0.5B, 2 distributions, 600 samples")
    ap.add_argument("--samples", type=int, default=None)
    args = ap.parse_args(argv)
    models = MODELS[:1] if args.quick else MODELS
    dists = ("lognormal", "bimodal") if args.quick else ("lognormal", "bimodal", "uniform")
    samples = args.samples or (600 if args.quick else 2000)
    print(f"{samples} SYNTHETIC samples per distribution (seed 0); job: "
          f"{JOB.train} {JOB.precision}, micro-batch {JOB.micro_batch}, cap {JOB.seq_len}, "
          f"loop {JOB.loop}; no GPU (unlimited allocator)")
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for dist in dists:
                for sampler in SAMPLERS:
                    print(show(cell(model, dist, sampler, samples, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
