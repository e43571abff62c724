"""The README's "Squeezing a job onto a small GPU": one 7B job on a 24 GB card, switch by switch.

    python experiments/squeeze_small_gpu.py [--no-write]

Runs `hybridmem predict ... --json` (the analytic tier, what `predict` answers by default here)
for each step's command line exactly as the README prints it, and writes the table between the
`squeeze:start` / `squeeze:end` markers of README.md. tests/test_squeeze_docs.py runs the same
commands and checks the README shows exactly these numbers, so the section cannot go stale.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
from doc_block import main_for  # noqa: E402

START, END = "<!-- squeeze:start -->", "<!-- squeeze:end -->"
GiB = 2**30

JOB = ["--model", "llava-1.5-7b", "--micro-batch", "4", "--seq-len", "2048",
       "--precision", "bf16", "--gpu", "rtx-4090", "--find-max-batch"]
"""LLaVA-1.5-7B (CLIP ViT-L/14-336 + Vicuna-7B), 4 samples of 2048 tokens (576 of them image
tokens), bf16 weights, on an RTX 4090 (24 GB)."""

STEPS: list[tuple[str, list[str]]] = [
    ("full fine-tune, AdamW", []),
    ("+ gradient checkpointing", ["--grad-ckpt"]),
    ("LoRA r=8 instead (with checkpointing)", ["--train", "lora", "--grad-ckpt"]),
    ("+ 4-bit NF4 base (QLoRA)", ["--train", "lora", "--grad-ckpt", "--quantize", "nf4"]),
    ("+ paged 8-bit AdamW", ["--train", "lora", "--grad-ckpt", "--quantize", "nf4",
                             "--optimizer", "paged-adamw-8bit"]),
    ("+ Liger kernels", ["--train", "lora", "--grad-ckpt", "--quantize", "nf4",
                         "--optimizer", "paged-adamw-8bit", "--liger"]),
]
"""Each step's own flags (added to `JOB`); the README prints them as written here."""


def run(flags: list[str]) -> dict:
    """`hybridmem predict JOB + flags --json` in this process."""
    from hybridmem.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["predict", *JOB, *flags, "--json"])
    if code not in (0, None):
        raise SystemExit(f"predict {' '.join(flags)} exited {code}")
    return json.loads(out.getvalue())


def row(label: str, flags: list[str], result: dict) -> str:
    peak = result["peak"]
    fits = "yes" if result["fits"] else "no"
    bd = result["breakdown"]
    return (f"| {label} | `{' '.join(flags) or '(none)'}` | {peak['device_bytes'] / GiB:.1f} | "
            f"{fits} | {result['max_micro_batch']} | {bd['param'] / GiB:.1f} | "
            f"{bd['activation'] / GiB:.1f} | {peak['phase']} |")


def table() -> str:
    lines = ["| step | flags added to the job | device peak (GiB) | fits 24 GB | max micro-batch "
             "| param (GiB) | activation (GiB) | peak phase |",
             "| --- | --- | ---: | :---: | ---: | ---: | ---: | --- |"]
    lines += [row(label, flags, run(flags)) for label, flags in STEPS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return main_for(table, ROOT / "README.md", START, END, argv)


if __name__ == "__main__":
    sys.exit(main())
