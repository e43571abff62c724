"""Reserved memory of the analytic tier: an approximate alloc/free stream (`analytic/events.py`)
replayed through the caching-allocator simulator (`allocator/reserved.py`).

What must hold whatever the stream's details: reserved >= allocated, the fragmentation
category is exactly reserved - allocated, the breakdown sums to device bytes, device bytes
never shrink as the micro-batch grows (find-max-batch bisects on them), the allocator options
in PYTORCH_ALLOC_CONF change the answer, and no torch import. Agreement with the trace tier
(which replays the real recorded stream through the same simulator) is checked on tiny configs
and on the issue's LLaVA-1.5-7B command, with tolerances justified next to each.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridmem import SpecError, TrainingSpec
from hybridmem.analytic import estimate

MiB = 1024**2
ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")

# the command: hybridmem predict --model llava-1.5-7b --seq-len 2048 --micro-batch 8
# --train llm+projector --grad-ckpt
LLAVA = TrainingSpec(model="llava-1.5-7b", seq_len=2048, micro_batch=8, train="llm+projector",
                     grad_ckpt=True)
# trace tier on that command (the numbers, `hybridmem predict --method trace`):
# allocated 136,490,637,312 B, reserved 145,357,799,424 B
LLAVA_TRACE_RESERVED = 145_357_799_424
LLAVA_TRACE_FRAG = LLAVA_TRACE_RESERVED - 136_490_637_312


@pytest.fixture(autouse=True)
def _default_allocator(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def tiny(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": "tiny-llava", "micro_batch": 2, "seq_len": 64, **kw})


@pytest.mark.parametrize("spec", [
    tiny(), tiny(precision="bf16-mixed", grad_ckpt=True), tiny(train="lora", precision="bf16"),
    tiny(precision="bf16-master"), tiny(model="tiny-llama", optimizer="adafactor"),
    tiny(model="tiny-llama", optimizer="lion"), LLAVA,
], ids=lambda s: f"{s.model}-{s.train}-{s.precision}-{s.optimizer}-ckpt{int(s.grad_ckpt)}")
def test_categories_are_consistent(spec):
    p = estimate(spec)
    assert p.peak.reserved_bytes >= p.peak.allocated_bytes
    assert p.breakdown["fragmentation"] == p.peak.reserved_bytes - p.peak.allocated_bytes
    assert sum(p.breakdown.values()) == p.peak.device_bytes
    assert p.peak.device_bytes == p.peak.reserved_bytes + p.breakdown["context"]
    assert p.breakdown["fragmentation"] > 0  # segments never fit a real stream exactly
    assert any(n.startswith("fragmentation: reserved - allocated of an approximate")
               for n in p.notes)


def test_llava_command_agrees_with_the_trace_tier():
    # the closed-form lower bound (2 MiB rounding only) was 8,388,608 B here, 6.1 points of
    # the reserved peak short; the replay must be within 3 points, the issue's bar for "far
    # off" (measured: -1.9 points, 5.7 vs 8.3 GiB, experiments/analytic_vs_trace.py --large)
    p = estimate(LLAVA)
    lower = p.extras["analytic"]["fragmentation_lower_bound"]
    assert lower < LLAVA_TRACE_FRAG / 10
    assert abs(p.breakdown["fragmentation"] - LLAVA_TRACE_FRAG) <= 0.03 * LLAVA_TRACE_RESERVED
    assert p.peak.allocated_bytes == 136_490_637_312  # unchanged: the closed form's


def test_device_bytes_never_shrink_with_the_micro_batch():
    # the replay alone is not monotone here (5.6 / 1.6 / 11.4 / 1.5 GiB at micro-batch 1..4),
    # and neither is the trace tier (3.6 / 1.9 / 12.3 / 2.2 GiB); `reserved.envelope` keeps
    # device bytes non-decreasing so find-max-batch can bisect
    base = dict(model="llava-1.5-7b", seq_len=2048, precision="bf16", train="llm+projector",
                attn="flash_attention_2")
    device = [estimate(TrainingSpec(micro_batch=b, **base)).peak.device_bytes
              for b in range(1, 6)]
    assert device == sorted(device)
    # ... without overstating a power of two that has more device bytes than the smaller
    # ones: at micro-batch 4 the replay's own 1.5 GiB (trace 2.2 GiB), not micro-batch 1's
    four = estimate(TrainingSpec(micro_batch=4, **base))
    assert four.breakdown["fragmentation"] < 2 * 1024**3


def test_allocator_options_are_respected(monkeypatch):
    default = estimate(LLAVA).breakdown["fragmentation"]
    # expandable segments map 2 MiB pages into one growing segment: freed pages are reused
    # by any size, so the fragmentation of split segments mostly disappears
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    expandable = estimate(LLAVA).breakdown["fragmentation"]
    assert expandable < default / 2
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:banana")
    with pytest.raises(SpecError):
        estimate(LLAVA)


def test_analytic_tier_still_imports_no_torch():
    code = ("import sys\nfrom hybridmem import TrainingSpec\nfrom hybridmem.analytic import "
            "estimate\nestimate(TrainingSpec(model='tiny-llava', grad_ckpt=True))\n"
            "bad = [m for m in ('torch', 'transformers', 'hybridmem.trace') "
            "if m in sys.modules]\nprint(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


trace = pytest.importorskip("hybridmem.trace")

# Tolerance on tiny configs: 4 MiB = two small-pool segments (kSmallBuffer, 2 MiB,
# CUDACachingAllocator.cpp). Tensors of these models are < 1 MiB and land in 2 MiB small
# segments; the order of the small per-op tensors the analytic stream does not model (weight
# casts, views, reductions) can cost or save whole small segments. Measured over the 108
# configs of experiments/analytic_vs_trace.py: at most 2.0 MiB apart.
TINY_TOL = 4 * MiB
TINY = [tiny(), tiny(precision="bf16", grad_ckpt=True), tiny(precision="bf16-mixed"),
        tiny(train="lora", precision="fp32"), tiny(model="tiny-llama", optimizer="sgd"),
        tiny(train="llm+projector", precision="bf16-mixed", grad_ckpt=True)]


@pytest.mark.parametrize("spec", TINY, ids=lambda s: f"{s.model}-{s.train}-{s.precision}-"
                         f"{s.optimizer}-ckpt{int(s.grad_ckpt)}")
def test_tiny_configs_agree_with_the_trace_tier(spec):
    a, t = estimate(spec), trace.estimate(spec)
    assert abs(a.breakdown["fragmentation"] - t.breakdown["fragmentation"]) <= TINY_TOL
