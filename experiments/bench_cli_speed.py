"""Seconds per `hybridmem predict` process against `python -c "import torch, transformers"`.

Issue 19 asks that an analytic answer for a preset or a `config.json` cost at most 0.35x that
floor per process (it cost 2.65x: the options were parsed after importing torch and
transformers). Runs README command 1 (with and without `--find-max-batch`), two other analytic
commands and the two config-file front doors (a LLaMA-Factory YAML through `--config`, a
TrainingArguments JSON through `--training-args`), each in a fresh process, interleaved with
the floor so both see the same machine load, and reports medians.
A benchmark, not a test: the ratio depends on the machine and its load.

    python experiments/bench_cli_speed.py [--runs 5] [--before DIR [--before-label TEXT]]
                                          [--only NAME ...] [--no-pyc]

`--before`: also time the same commands with another checkout's package (e.g. the main
branch before this change). Bytecode: an installed package has its `.pyc` files (pip writes
them), as torch and transformers do here; so each command runs with bytecode caching on
(PYTHONDONTWRITEBYTECODE unset, PYTHONPYCACHEPREFIX a temporary folder) after one untimed
run that writes it. `--no-pyc` keeps the environment as it is (a checkout run with
PYTHONDONTWRITEBYTECODE=1 compiles every hybridmem module in every process).
Writes experiments/results/cli_speed.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "cli_speed.md"
FLOOR = [sys.executable, "-c", "import torch, transformers"]

INPUTS = "{inputs}"  # this checkout's inputs, also for a --before checkout without them
README_1 = ["--model", "llava-1.5-7b", "--micro-batch", "8", "--seq-len", "2048",
            "--train", "llm+projector", "--grad-ckpt", "--precision", "bf16-master",
            "--gpu", "h100-80gb"]
COMMANDS: dict[str, list[str]] = {
    # README.md, command 1 (its fit advice searches world sizes: the allocator replays dominate)
    "README command 1": [*README_1, "--find-max-batch"],
    "README command 1, no --find-max-batch": README_1,
    "QLoRA on 24 GB, --json": ["--model", "llava-1.5-7b", "--train", "lora", "--quantize", "nf4",
                               "--precision", "bf16", "--grad-ckpt", "--micro-batch", "4",
                               "--gpu-mem", "24", "--json"],
    "config.json path, LoRA": ["--model", "{root}/hybridmem/families/decoders/presets/qwen3-8b.json",
                               "--train", "lora", "--seq-len", "4096", "--json"],
    # LLaMA-Factory's examples/train_lora/llama3_lora_sft.yaml (bench_inputs says which model)
    "--config LLaMA-Factory YAML": ["--config", f"{INPUTS}/llamafactory_lora_sft.yaml",
                                    "--gpu", "a100-40gb"],
    # `TrainingArguments(...).to_json_string()` of transformers 5.24: every field, 114 keys
    "--training-args TrainingArguments JSON": [
        "--model", "llama-3.2-3b", "--train", "lora", "--training-args",
        f"{INPUTS}/training_args.json", "--gpu", "a100-40gb"],
}


PYC: dict[str, str] = {}
"""Extra environment of every timed process (`--no-pyc` leaves it empty)."""


def timed(argv: list[str], checkout: Path | None = None) -> float:
    """Wall seconds of one process (`checkout`: its package first on the path, cwd there)."""
    env = {k: v for k, v in os.environ.items() if not (PYC and k == "PYTHONDONTWRITEBYTECODE")}
    env.update(PYC)
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
            *(a.format(root=checkout, inputs=ROOT / "experiments" / "bench_inputs")
              for a in args)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--before", type=Path, default=None)
    parser.add_argument("--before-label", default=None,
                        help="What --before is, for the report (e.g. a commit).")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                        help="Time only the commands whose name contains one of these words.")
    parser.add_argument("--no-pyc", action="store_true",
                        help="Leave bytecode caching as the environment has it.")
    args = parser.parse_args()
    checkouts = {"after": ROOT} | ({"before": args.before.resolve()} if args.before else {})
    commands = {name: argv for name, argv in COMMANDS.items()
                if not args.only or any(word in name for word in args.only)}
    if not args.no_pyc:
        PYC["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="bench_cli_pyc_")
        for label, checkout in checkouts.items():  # untimed: writes the bytecode
            for argv in commands.values():
                timed(cli(checkout, argv), checkout)
        timed(FLOOR)
    floor: list[float] = []
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.runs):  # interleaved: each round sees the same load
        floor.append(timed(FLOOR))
        for label, checkout in checkouts.items():
            for name, argv in commands.items():
                times.setdefault((label, name), []).append(timed(cli(checkout, argv), checkout))
    base = statistics.median(floor)
    lines = [
        "# `hybridmem predict` seconds per process vs the torch + transformers import floor",
        "",
        f"Written by `experiments/bench_cli_speed.py --runs {args.runs}"
        + (" --before DIR" if args.before else "") + (" --no-pyc" if args.no_pyc else "")
        + f"`; medians of {args.runs} "
        "interleaved runs. Floor: `python -c \"import torch, transformers\"` = "
        f"{base:.2f} s. Aim (issue 19): at most 0.35x the floor for an analytic answer."
        + (f" Before: {args.before_label or args.before}." if args.before else "")
        + (" Bytecode compiled on every run." if args.no_pyc else
           " With bytecode caches, as an installed package."),
        "",
        "| command | " + " | ".join(f"{label} s | {label} x floor" for label in checkouts) + " |",
        "|---|" + "---:|---:|" * len(checkouts),
    ]
    for name in commands:
        cells = []
        for label in checkouts:
            med = statistics.median(times[(label, name)])
            cells += [f"{med:.2f}", f"{med / base:.2f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Commands (`hybridmem predict ...`):", ""]
    shown = {"root": ".", "inputs": "experiments/bench_inputs"}
    lines += [f"- {name}: `{' '.join(a.format(**shown) for a in argv)}`"
              for name, argv in commands.items()]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
