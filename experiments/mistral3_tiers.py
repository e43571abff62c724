"""Mistral-3 per tier: trace vs a real CPU run (tiny-mistral3, tiny-llava-pixtral) and analytic
vs trace (tiny and, with --real, mistral-small-3.1-24b-instruct-2503 / pixtral-12b); the numbers
of docs/vlm-families.md "Mistral-3".

    PYTHONPATH=. python experiments/mistral3_tiers.py [--real]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hybridmem.analytic import estimate as analytic  # noqa: E402
from hybridmem.models import load_config  # noqa: E402
from hybridmem.job.spec import TrainingSpec  # noqa: E402
from hybridmem.trace import estimate as trace_estimate, runner  # noqa: E402

TINY_KW = [dict(precision="fp32"), dict(precision="bf16"), dict(precision="bf16-mixed"),
           dict(precision="bf16-mixed", train="llm+projector"),
           dict(precision="bf16", grad_ckpt=True), dict(precision="bf16-mixed", train="lora")]
REAL_KW = [dict(train="lora", grad_ckpt=True), dict(train="lora", precision="bf16"),
           dict(train="llm+projector", precision="bf16", grad_ckpt=True, image_size=None)]
PIXTRAL_12B_KW = [dict(seq_len=4096, image_size="768x768", train="lora", grad_ckpt=True),
                  dict(seq_len=8192, image_size=None, train="llm+projector", precision="bf16",
                       grad_ckpt=True)]


def tensors(pred) -> int:
    return pred.peak.allocated_bytes - pred.breakdown["workspace"]


def row(spec: TrainingSpec, real: bool) -> str:
    a, t = analytic(spec), trace_estimate(spec)
    cells = [f"{tensors(t):,}"]
    if real:
        from test_trace import real_cpu_peak

        tracker, _ = runner.trace(spec, load_config(spec.model), backend="meta")
        cells = [f"{int(tracker.live_curve(device_only=False).max()):,}",
                 f"{real_cpu_peak(spec):,}"]
    diff = (tensors(a) - tensors(t)) / tensors(t) * 100
    return f"| {' | '.join(cells)} | {diff:+.2f} % ({a.peak.phase} / {t.peak.phase})"


def main() -> None:
    for kw in TINY_KW:
        spec = TrainingSpec(model="tiny-mistral3", micro_batch=2, seq_len=64,
                            image_size="112x84", **kw)
        print("tiny b2 s64 112x84", kw, row(spec, real=True), flush=True)
        spec = spec.with_(seq_len=128, image_size="224x168")
        print("tiny b2 s128 224x168", kw, row(spec, real=False), flush=True)
        spec = TrainingSpec(model="tiny-llava-pixtral", micro_batch=2, seq_len=128,
                            image_size="128x96", **kw)
        print("tiny-llava-pixtral b2 s128 128x96", kw, row(spec, real=True), flush=True)
    if "--real" in sys.argv:
        for kw in REAL_KW:
            spec = TrainingSpec(model="mistral-small-3.1-24b-instruct-2503", micro_batch=1,
                                seq_len=4096, **{"image_size": "1024x1024", **kw})
            print("24b b1 s4096", kw, row(spec, real=False), flush=True)
        for kw in PIXTRAL_12B_KW:
            spec = TrainingSpec(model="pixtral-12b", micro_batch=1, **kw)
            print("pixtral-12b b1", kw, row(spec, real=False), flush=True)
    for kw in TINY_KW:  # a vision-heavy tiny step: 1024 patches (a 1024 x 1024 mask) per image
        spec = TrainingSpec(model="tiny-mistral3", micro_batch=2, seq_len=512,
                            image_size="448x448", **kw)
        print("tiny b2 s512 448x448", kw, row(spec, real=False), flush=True)


if __name__ == "__main__":
    main()
