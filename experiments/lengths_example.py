"""The per-step reserved distribution of one job over 100,000 SYNTHETIC lengths -> docs/lengths.md.

    python experiments/lengths_example.py [--no-write]

The analytic tier prices `bench_lengths.JOB` (llama-3.2-3b LoRA, shaped like the peft MetaMathQA
benchmark's) over `bench_lengths.synthetic` token counts (a seeded log-normal, no dataset's
distribution), per sampler: reserved per step (p50 / p99 / max) beside the job priced at the
cap (`--seq-len` 768) and at the run's longest batch, and the wall time of the `--lengths`
answer. Written between the `lengths:example` markers of docs/lengths.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
from bench_lengths import runs  # noqa: E402
from doc_block import main_for  # noqa: E402

VARIANTS = ({"sampler": "random"}, {"sampler": "group_by_length"},
            {"sampler": "random", "max_steps": 100})
"""Both samplers over one epoch, and a short run (its longest batch is below the cap)."""
START, END = "<!-- lengths:example:start -->", "<!-- lengths:example:end -->"


def table() -> str:
    out = runs(100_000, "analytic", variants=VARIANTS)
    head = ("| sampler | max steps | steps | longest batch | reserved per step p50 / p99 / max | at the "
            "longest batch | at the cap (768) | wall |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in out["runs"]:
        p = r["reserved_per_step_gib"]
        lb = r["longest_batch"]
        lines.append(
            f"| {r['sampler']} | {r.get('max_steps') or 'one epoch'} | {r['steps']:,} | {lb['batch']} x {lb['tokens']} (step "
            f"{lb['first_step']:,}) | {p['p50']:.2f} / {p['p99']:.2f} / {p['max']:.2f} GiB | "
            f"{r['reserved_at_longest_batch_gib']:.2f} GiB | "
            f"{r['reserved_fixed_at_cap_gib']:.2f} GiB | {r['wall_s']:.1f} s |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main_for(table, ROOT / "docs" / "lengths.md", START, END))
