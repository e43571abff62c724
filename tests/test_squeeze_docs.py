"""README's "Squeezing a job onto a small GPU" table is what the code answers today.

`experiments/squeeze_small_gpu.py` runs each step's `hybridmem predict ... --json` exactly as the
README prints it and writes the table between the `squeeze` markers; this test runs the same
commands (analytic tier, a few seconds) and compares, so editing the code without re-running the
script (or the README by hand) fails here. It also checks the direction each switch must move
the breakdown in, derived from what the switch does (not from the code's numbers).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import squeeze_small_gpu as squeeze  # noqa: E402


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return [squeeze.run(flags) for _, flags in squeeze.STEPS]


def test_readme_table_is_the_codes_answer(results):
    text = (ROOT / "README.md").read_text()
    block = re.search(re.escape(squeeze.START) + r"\n(.*?)\n" + re.escape(squeeze.END), text, re.S)
    assert block, "README.md has no squeeze markers"
    rows = [squeeze.row(label, flags, r) for (label, flags), r in zip(squeeze.STEPS, results)]
    assert block.group(1).splitlines()[2:] == rows


def test_each_switch_moves_the_breakdown_where_it_should(results):
    full, ckpt, lora, nf4, paged, liger = results
    bd = [r["breakdown"] for r in results]
    # checkpointing keeps one input per layer: less activation, the peak leaves backward
    assert bd[1]["activation"] < bd[0]["activation"]
    # LoRA: the frozen base has no gradients or AdamW state
    assert bd[2]["grad"] + bd[2]["optimizer"] < (bd[1]["grad"] + bd[1]["optimizer"]) / 100
    # NF4: about half a byte per base weight instead of two (bf16), quant state on top
    assert bd[3]["param"] < bd[2]["param"] / 2.5
    # 8-bit AdamW: two uint8 states (+ an fp32 absmax per 256) instead of two fp32 ones, about
    # 1/4; bitsandbytes pages only states of >= 1e5 elements, and LoRA r=8's are smaller
    assert bd[4]["optimizer"] < bd[3]["optimizer"] / 3.5 and paged["paged_bytes"] == 0
    # Liger: no fp32 logits or their gradient; the micro-batch that fits grows
    assert liger["max_micro_batch"] >= nf4["max_micro_batch"]
    assert [r["fits"] for r in results] == [False, False, True, True, True, True]
