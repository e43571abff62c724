"""Seconds per `hybridmem predict` process against `python -c "import torch, transformers"`.

Issue 19 asks that an analytic answer for a preset or a `config.json` cost at most 0.35x that
floor per process (it cost 2.65x: the options were parsed after importing torch and
transformers). Runs README command 1 and two other analytic commands, each in a fresh
process, interleaved with the floor so both see the same machine load, and reports medians.
A benchmark, not a test: the ratio depends on the machine and its load.

    python experiments/bench_cli_speed.py [--runs 5] [--before DIR [--before-label TEXT]]

`--before`: also time the same commands with another checkout's package (e.g. the main
branch before this change). Writes experiments/results/cli_speed.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "cli_speed.md"
FLOOR = [sys.executable, "-c", "import torch, transformers"]

COMMANDS: dict[str, list[str]] = {
    # README.md, command 1 (its fit advice searches world sizes: the allocator replays dominate)
    "README command 1": ["--model", "llava-1.5-7b", "--micro-batch", "8", "--seq-len", "2048",
                         "--train", "llm+projector", "--grad-ckpt", "--precision",
                         "bf16-master", "--gpu", "h100-80gb", "--find-max-batch"],
    "QLoRA on 24 GB, --json": ["--model", "llava-1.5-7b", "--train", "lora", "--quantize", "nf4",
                               "--precision", "bf16", "--grad-ckpt", "--micro-batch", "4",
                               "--gpu-mem", "24", "--json"],
    "config.json path, LoRA": ["--model", "{root}/hybridmem/families/decoders/presets/qwen3-8b.json",
                               "--train", "lora", "--seq-len", "4096", "--json"],
}


def timed(argv: list[str], checkout: Path | None = None) -> float:
    """Wall seconds of one process (`checkout`: its package first on the path, cwd there)."""
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = str(checkout)
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=checkout or ROOT, env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr}")
    return took


def cli(checkout: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "hybridmem", "predict",
            *(a.format(root=checkout) for a in args)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--before", type=Path, default=None)
    parser.add_argument("--before-label", default=None,
                        help="What --before is, for the report (e.g. a commit).")
    args = parser.parse_args()
    checkouts = {"after": ROOT} | ({"before": args.before.resolve()} if args.before else {})
    floor: list[float] = []
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.runs):  # interleaved: each round sees the same load
        floor.append(timed(FLOOR))
        for label, checkout in checkouts.items():
            for name, argv in COMMANDS.items():
                times.setdefault((label, name), []).append(timed(cli(checkout, argv), checkout))
    base = statistics.median(floor)
    lines = [
        "# `hybridmem predict` seconds per process vs the torch + transformers import floor",
        "",
        f"Written by `experiments/bench_cli_speed.py --runs {args.runs}"
        + (" --before DIR" if args.before else "") + f"`; medians of {args.runs} "
        "interleaved runs. Floor: `python -c \"import torch, transformers\"` = "
        f"{base:.2f} s. Aim (issue 19): at most 0.35x the floor for an analytic answer."
        + (f" Before: {args.before_label or args.before}." if args.before else ""),
        "",
        "| command | " + " | ".join(f"{label} s | {label} x floor" for label in checkouts) + " |",
        "|---|" + "---:|---:|" * len(checkouts),
    ]
    for name in COMMANDS:
        cells = []
        for label in checkouts:
            med = statistics.median(times[(label, name)])
            cells += [f"{med:.2f}", f"{med / base:.2f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Commands (`hybridmem predict ...`):", ""]
    lines += [f"- {name}: `{' '.join(a.format(root='.') for a in argv)}`"
              for name, argv in COMMANDS.items()]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
