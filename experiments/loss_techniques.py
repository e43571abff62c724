"""Peak with / without `--liger`, `--chunked-ce N`, `--cut-cross-entropy`, analytic vs trace
(docs/loss.md).

    PYTHONPATH=. python experiments/loss_techniques.py            # llama-3.2-3b mb4 s2048
    PYTHONPATH=. python experiments/loss_techniques.py --cce      # the same, bf16 LoRA + CCE
    PYTHONPATH=. python experiments/loss_techniques.py --tiny     # the tiny-llama grid

Prints allocated (and reserved) GiB of both tiers and the phase of the peak; the tiny grid
prints the tensor peak (allocated minus the two cuBLAS workspaces) in MiB.
"""

from __future__ import annotations

import itertools
import sys

from hybridmem import TrainingSpec
from hybridmem.analytic import estimate as analytic
from hybridmem.trace import estimate as trace

GiB, MiB = 2**30, 2**20
TECHNIQUES = ({}, {"liger": True}, {"chunked_ce": 8})


def big() -> None:
    for extra in TECHNIQUES:
        spec = TrainingSpec(model="llama-3.2-3b", micro_batch=4, seq_len=2048, **extra)
        a, t = analytic(spec), trace(spec)
        print(f"{extra!s:20} analytic {a.peak.allocated_bytes / GiB:6.2f} "
              f"({a.peak.reserved_bytes / GiB:6.2f}) {a.peak.phase}@{a.peak.iteration}  "
              f"trace {t.peak.allocated_bytes / GiB:6.2f} ({t.peak.reserved_bytes / GiB:6.2f}) "
              f"{t.peak.phase}@{t.peak.iteration}", flush=True)


def cce() -> None:
    """HF's loss, Liger, CCE on llama-3.2-3b bf16 LoRA (CCE needs bf16 / fp16 weights)."""
    for extra in ({}, {"liger": True}, {"cut_cross_entropy": True}):
        spec = TrainingSpec(model="llama-3.2-3b", micro_batch=4, seq_len=2048, precision="bf16",
                            train="lora", **extra)
        a, t = analytic(spec), trace(spec)
        print(f"{extra!s:28} analytic {a.peak.allocated_bytes / GiB:6.2f} "
              f"({a.peak.reserved_bytes / GiB:6.2f}) {a.peak.phase}@{a.peak.iteration}  "
              f"trace {t.peak.allocated_bytes / GiB:6.2f} ({t.peak.reserved_bytes / GiB:6.2f}) "
              f"{t.peak.phase}@{t.peak.iteration}", flush=True)


def tiny() -> None:
    for extra, prec, train, ckpt in itertools.product(
            ({"liger": True}, {"chunked_ce": 4}), ("fp32", "bf16", "bf16-mixed"),
            ("full", "lora"), (False, True)):
        spec = TrainingSpec(model="tiny-llama", micro_batch=2, seq_len=128, precision=prec,
                            train=train, grad_ckpt=ckpt, **extra)
        a, t = analytic(spec), trace(spec)
        ta = a.peak.allocated_bytes - a.breakdown["workspace"]
        tt = t.peak.allocated_bytes - t.breakdown["workspace"]
        print(f"{extra!s:18} {prec:10} {train:5} ckpt={ckpt!s:5} analytic {ta / MiB:7.3f} "
              f"trace {tt / MiB:7.3f} {100 * (ta - tt) / tt:+6.2f}%", flush=True)


if __name__ == "__main__":
    tiny() if "--tiny" in sys.argv else cce() if "--cce" in sys.argv else big()
